"""`producer/source.py` with modes: each sample rendered with its conversation's mode's
kwargs and sent with its sampling, on the templates of two families whose thinking switch
differs: Qwen3's `enable_thinking` and Kimi-K2.5's `thinking`. Both modes' prompt ids are
exactly `apply_chat_template` with the mode's kwargs; a mode's kwarg the template never
reads is refused at load, naming the mode's field."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from foundation.errors import ConfigError
from producer.run import load_renderer
from producer.source import CategorySource
from tests.conftest import QWEN, write_config
from tests.family_tokenizers import kimi

QWEN3 = QWEN.parent / "qwen3"
RECORDS = 40


def config(tmp: Path, tokenizer: Path, switch: str, extra_kwargs: str = ""):
    src = tmp / "src.jsonl"
    src.write_text("".join(json.dumps({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": f"What is {i} + {i}?"}]}) + "\n" for i in range(RECORDS)))
    return write_config(tmp, f"""
run = "modes"
output_dir = "{tmp / 'out'}"
tokenizer = "{tokenizer}"
cap_tokens = 100000
[[category]]
name = "c"
source = "{src}"
sampling = {{ max_new_tokens = 64, temperature = 1.0 }}
modes = [{{ name = "think", weight = 0.5, chat_template_kwargs = {{ {switch} = true }} }}, \
{{ name = "fast", weight = 0.5, chat_template_kwargs = {{ {switch} = false {extra_kwargs} }}, \
sampling = {{ temperature = 0.6 }} }}]
""")


@pytest.fixture(scope="module")
def kimi_folder(tmp_path_factory) -> Path:
    return kimi(tmp_path_factory.mktemp("kimi"))


@pytest.mark.parametrize("family", ["qwen3", "kimi-k2.5"])
def test_each_mode_renders_as_the_models_own_template(tmp_path, family, kimi_folder) -> None:
    tokenizer, switch = {"qwen3": (QWEN3, "enable_thinking"),
                         "kimi-k2.5": (kimi_folder, "thinking")}[family]
    cfg = config(tmp_path, tokenizer, switch)
    renderer = load_renderer(cfg)
    assert renderer is not None
    tok = renderer.tokenizer
    cat = cfg.by_name("c")
    with CategorySource.open(cfg, cat, renderer) as source:
        samples = [source.read(p) for p in range(len(source))]
        pending, rejected = source.prepare(samples)
    assert not rejected and len(pending) == RECORDS
    seen = set()
    for p, s in zip(pending, samples, strict=True):
        thinking = p.mode == "think"
        seen.add(p.mode)
        assert p.mode == source.mode_of(s.sample_id).name  # type: ignore[union-attr]
        assert p.chat_template_kwargs == {switch: thinking}
        assert p.sampling["temperature"] == (1.0 if thinking else 0.6)
        expected = tok.apply_chat_template(s.prompt, add_generation_prompt=True,
                                           tokenize=True, return_dict=False,
                                           **{switch: thinking})
        assert p.prompt_ids == list(expected), (family, p.sample_id)
    assert seen == {"think", "fast"}
    # the two modes render differently: the switch is read
    think = next(p for p in pending if p.mode == "think")
    as_fast = tok.apply_chat_template(samples[pending.index(think)].prompt,
                                      add_generation_prompt=True, tokenize=True,
                                      return_dict=False, **{switch: False})
    assert think.prompt_ids != list(as_fast)


def test_a_modes_kwarg_the_template_never_reads_is_refused(tmp_path, kimi_folder) -> None:
    cfg = config(tmp_path, kimi_folder, "thinking", extra_kwargs=", enable_thinking = false")
    with pytest.raises(ConfigError, match=r"\$.category\[0\].modes\[1\].chat_template_kwargs"
                       r".enable_thinking.*never reads `enable_thinking`"):
        load_renderer(cfg)
