"""The oracle for FP8 hidden states: speculators' own quantization (hs-connectors'
`fp8_utils`, merged in speculators PR #1028, shipped in hs-connectors 0.9.0) and tokencap's
connector's, of the states in a safetensors file.

Run with the trainers' venv's Python (torch, hs-connectors, and vLLM through the engine
venv's packages):

    python fp8_oracle.py STATES.safetensors OUT.npz

Writes OUT.npz: `hs_q` (speculators' float8_e4m3fn payload, as uint8 bytes), `hs_scales`
(its float32 scales [T, 1, 1]), `hs_deq` (its dequantization, `fp8.to(bf16) *
scale.to(bf16)`, as bfloat16 bit patterns), and `tc_q`, `tc_scales` (what
`tokencap.engine_side.vllm_connector.to_fp8` makes of the same states).
"""

from __future__ import annotations

import sys


def main() -> int:
    import numpy as np
    import torch
    from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8
    from safetensors.torch import load_file

    from tokencap.engine_side.vllm_connector import to_fp8

    states = load_file(sys.argv[1])["hidden_states"]
    q, scales = quantize_tensor_to_fp8(states)
    deq = dequantize_fp8_tensor(q, scales)
    tq, tscales = to_fp8(states)
    np.savez(sys.argv[2], hs_q=q.view(torch.uint8).numpy(), hs_scales=scales.numpy(),
             hs_deq=deq.view(torch.int16).numpy().view(np.uint16),
             tc_q=tq.view(torch.uint8).numpy(), tc_scales=tscales.numpy())
    return 0


if __name__ == "__main__":
    sys.exit(main())
