"""The hidden states' disk plan (`tokencap plan` with `[hidden_states]`, `hidden-states
--plan`): bytes per token from the model's config, per category under its byte budget and in
all; `plan --check` refuses (exit 2) states that would not fit the free space; the config
refuses layer ids the model does not have."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from foundation.config import load_config
from foundation.errors import ConfigError
from tests.conftest import DATASETS, FIXTURES
from tokencap.cli.offline import plan_cmd

GSM8K = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"


def config(tmp, hidden: int, layers: int = 36, extra: str = "") -> str:
    model = tmp / "config.json"
    model.write_text(json.dumps({"num_hidden_layers": layers, "hidden_size": hidden,
                                 "torch_dtype": "bfloat16"}))
    path = tmp / "run.toml"
    path.write_text(f"""
run = "p"
output_dir = "{tmp / 'out'}"
tokenizer = "{FIXTURES / 'tokenizers' / 'qwen3'}"
[hidden_states]
model_config = "{model}"
output_dir = "{tmp / 'hs'}"
{extra}
[[category]]
name = "a"
source = "{GSM8K}"
cap_tokens = 100000
sampling = {{ max_new_tokens = 512 }}
""")
    return str(path)


def test_the_plan_gives_the_states_bytes_under_the_budget(tmp_path) -> None:
    path = config(tmp_path, 4096, extra="max_bytes = { a = 1_000_000_000 }")
    cfg = load_config(path)
    assert cfg.hidden_states.layers == [2, 18, 33, 36]  # Qwen3-8B's shape: EAGLE-3's ids
    res = CliRunner().invoke(plan_cmd, [path])
    assert res.exit_code == 0, res.output
    assert "32,776 bytes per token" in res.output  # 4 x 4096 x 2 + the id
    assert "30,510 tokens" in res.output and "(budget 1.00 GB)" in res.output  # 1e9 // 32,776


def test_plan_check_refuses_states_that_would_not_fit_the_disk(tmp_path) -> None:
    path = config(tmp_path, 2_000_000_000)  # 16 GB a token: no disk holds a category
    res = CliRunner().invoke(plan_cmd, [path, "--check"])
    assert res.exit_code == 10 and "GB free" in res.output and "Traceback" not in res.output


@pytest.mark.parametrize("layers,extra", [(36, "layers = [2, 18, 33, 40]"),
                                          (36, "layers = [2, 18, 18, 36]"),
                                          (5, "")])
def test_layer_ids_the_model_does_not_have_are_refused(tmp_path, layers, extra) -> None:
    with pytest.raises(ConfigError, match=r"hidden_states\.layers"):
        load_config(config(tmp_path, 64, layers, extra))
