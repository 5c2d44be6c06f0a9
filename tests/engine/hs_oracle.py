"""The oracle for vLLM's hidden-state extraction: transformers' own forward of the model.

Run with the engine venv's Python (it has torch and transformers):

    python hs_oracle.py MODEL_DIR LAYERS OUT.npy < ids.json

`ids.json` is a JSON list of token ids (or a list of such lists: then OUT is an .npz of one
array per list, named "0", "1", ..., the model loaded once), LAYERS comma-separated layer ids
in vLLM's convention (id k = the residual stream after k decoder layers, 0 = the
embeddings). Writes a float32 array [tokens, len(LAYERS), hidden]: for k < N (N = the model's
layer count), transformers' `hidden_states[k]`; for k = N, the input of the final norm
(`model.model.norm`, caught with a forward pre-hook), since transformers' `hidden_states[N]`
is after that norm while vLLM's id N is before it. The forward runs in float32 with eager attention.
"""

from __future__ import annotations

import json
import sys


def main() -> int:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    model_dir, layers_arg, out = sys.argv[1:4]
    layers = [int(x) for x in layers_arg.split(",")]
    given = json.load(sys.stdin)
    batch = bool(given) and isinstance(given[0], list)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="eager")
    model.eval()
    n = model.config.num_hidden_layers
    if any(k < 0 or k > n for k in layers):
        sys.exit(f"layer ids {layers} outside 0..{n}")
    pre_norm: list[torch.Tensor] = []
    model.model.norm.register_forward_pre_hook(
        lambda _module, args: pre_norm.append(args[0].detach().clone()))

    def states(ids: list[int]) -> np.ndarray:
        pre_norm.clear()
        with torch.no_grad():
            res = model(input_ids=torch.tensor([ids], dtype=torch.long),
                        output_hidden_states=True, use_cache=False)
        assert len(pre_norm) == 1, "the final norm ran more than once"
        picked = [pre_norm[0][0] if k == n else res.hidden_states[k][0] for k in layers]
        return torch.stack(picked, dim=1).to(torch.float32).numpy()

    if batch:
        np.savez(out, **{str(i): states(ids) for i, ids in enumerate(given)})
    else:
        np.save(out, states(given))
    return 0


if __name__ == "__main__":
    sys.exit(main())
