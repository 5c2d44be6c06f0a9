"""The model's own sampling: a category's unset params come from the model's
generation_config.json, are sent explicitly on every request, stored in every row and shown
by preview; a run with no temperature anywhere refuses to start unless it says
`sampling_defaults = "engine"` on purpose."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from foundation.config import load_config
from foundation.errors import ConfigError
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.conftest import DATASETS, QWEN, write_config
from tokencap.cli.main import main
from tokencap.prepare.plan import preview

GSM8K = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"
MODEL = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


def tokenizer_dir(tmp: Path, generation: dict | None) -> Path:
    """The Qwen2.5 fixture tokenizer, with the given generation_config.json (or none)."""
    folder = tmp / "tok"
    folder.mkdir()
    for name in ("tokenizer_config.json", "vocab.json", "merges.txt"):
        shutil.copy(QWEN / name, folder / name)
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
             **generation}))
    return folder


def run_toml(tmp: Path, tok: Path, head: str = "", sampling: str = "max_new_tokens = 64") -> Path:
    path = tmp / "run.toml"
    path.write_text(f"""
run = "samp"
output_dir = "{tmp / 'out'}"
tokenizer = "{tok}"
cap_tokens = 3000
{head}
[[category]]
name = "qa"
source = "{GSM8K}"
sampling = {{ {sampling} }}
""")
    return path


def test_the_models_defaults_reach_every_request_row_and_preview(tmp_path, redis_url) -> None:
    cfg = load_config(run_toml(tmp_path, tokenizer_dir(tmp_path, MODEL)))
    effective = {"max_new_tokens": 64, **MODEL}
    assert msgspec.to_builtins(cfg.category[0].sampling) == effective
    # the model's end-of-turn ids (its eos and the generation config's) are sent too
    effective["stop_token_ids"] = [151643, 151645]
    [p] = preview(cfg)
    assert p.sampling == effective
    with SimServer(time_scale=400.0) as sim, started(cfg, redis_url, [sim.url], 4) as pipe:
        status = pipe.run()
        pipe.check_invariants(status)
        sent = sim.requests()
        rows = pipe.results("qa")
    assert sent and rows
    assert all(s == effective for s in sent), sent[:3]
    assert all(r.sampling == effective for r in rows)


def test_the_categorys_own_values_win(tmp_path) -> None:
    cfg = load_config(run_toml(tmp_path, tokenizer_dir(tmp_path, MODEL),
                               sampling="max_new_tokens = 64, temperature = 0.2, top_k = -1"))
    s = cfg.category[0].sampling
    assert (s.temperature, s.top_k, s.top_p) == (0.2, -1, 0.95)


def test_no_temperature_anywhere_refuses_to_start(tmp_path) -> None:
    path = run_toml(tmp_path, tokenizer_dir(tmp_path, None))
    with pytest.raises(ConfigError, match=r"\$\.category\[0\]\.sampling: no temperature"):
        load_config(path)
    res = CliRunner().invoke(main, ["run", str(path), "--dry-run"])
    assert res.exit_code == 2 and "no temperature" in res.output
    assert res.exception is None or isinstance(res.exception, SystemExit)
    # a generation config without one does not help either
    other = tmp_path / "other"
    other.mkdir()
    path = run_toml(other, tokenizer_dir(other, {"top_p": 0.9}))
    with pytest.raises(ConfigError, match="no temperature"):
        load_config(path)


def test_engine_defaults_on_purpose_send_only_what_is_set(tmp_path, redis_url) -> None:
    cfg = load_config(run_toml(tmp_path, tokenizer_dir(tmp_path, MODEL),
                               head='sampling_defaults = "engine"'))
    with SimServer(time_scale=400.0) as sim, started(cfg, redis_url, [sim.url], 2) as pipe:
        pipe.run()
        sent = sim.requests()
    assert sent and all(s == {"max_new_tokens": 64} for s in sent)


def test_an_explicit_generation_config_and_a_bad_one(tmp_path) -> None:
    gen = tmp_path / "gen.json"
    gen.write_text(json.dumps({"temperature": 0.3, "top_p": 2.0}))
    path = run_toml(tmp_path, tokenizer_dir(tmp_path, None), head=f'generation_config = "{gen}"')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(gen) in str(info.value) and "top_p" in str(info.value)
    gen.write_text(json.dumps({"temperature": 0.3}))
    cfg = write_config(tmp_path, path.read_text(), name="again.toml")
    assert cfg.category[0].sampling.temperature == 0.3
    assert cfg.generation_config == str(gen)
