"""The simulator's vLLM mode answers tokencap's requests as vLLM 0.32.0 does: the protocol
checks `make test-engine` runs against the real engine (tests/engine_protocol.py) give the
same facts here."""

from __future__ import annotations

from sglang_sim.testing import SimServer
from tests.conftest import QWEN
from tests.engine_protocol import differences, facts

QWEN_EOS = 151645  # <|im_end|>
QWEN_VOCAB = 151665


def test_the_simulators_vllm_mode_answers_as_vllm_does() -> None:
    with SimServer(time_scale=1000.0, flavor="vllm", tokenizer=str(QWEN),
                   context_length=4096) as sim:
        found = facts(sim.url, QWEN_EOS, QWEN_VOCAB)
    assert differences(found) == {}
