"""Chat-template rendering and tokenization with the fixture tokenizers (offline)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from foundation.errors import TokencapError
from producer.formats.records import Rejected
from producer.readers.index import SourceIndex, read_sample
from producer.render import Renderer, TokenizerError
from tests.conftest import DATASETS, FIXTURES, QWEN

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read when transformers is first imported

PHI3 = FIXTURES / "tokenizers" / "phi-3-mini"
PROMPTS_PER_FILE = 40

# From PROVENANCE.md (transformers 5.24 / tokenizers 0.23).
QWEN_HI_TEXT = (
    "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant."
    "<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
)
# fmt: off
QWEN_HI_IDS = [
    151644, 8948, 198, 2610, 525, 1207, 16948, 11, 3465, 553, 54364, 14817, 13, 1446, 525, 264,
    10950, 17847, 13, 151645, 198, 151644, 872, 198, 6023, 151645, 198, 151644, 77091, 198,
]
# fmt: on
PHI3_HI_TEXT = "<|user|>\nhi<|end|>\n<|assistant|>\n"
PHI3_HI_IDS = [32010, 2918, 32007, 32001]
PHI3_SPECIALS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")

# A Qwen3-style template: an empty think block after the generation prompt when
# enable_thinking is false, and an error for a conversation that opens with the assistant.
THINKING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if loop.first and message.role == 'assistant' %}"
    "{{ raise_exception('Conversation must start with a user or system turn') }}"
    "{%- endif %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)
HI = [{"role": "user", "content": "hi"}]


def _tokenizer_dir(folder: Path, chat_template: str | None) -> Path:
    """A Qwen tokenizer folder with another chat template (or none)."""
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(QWEN / name, folder / name)
    config = json.loads((QWEN / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    if chat_template is not None:
        config["chat_template"] = chat_template
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return folder


@pytest.fixture(scope="module")
def qwen() -> Renderer:
    return Renderer(QWEN)


@pytest.fixture(scope="module")
def phi3() -> Renderer:
    return Renderer(PHI3)


@pytest.fixture(scope="module")
def thinking(tmp_path_factory: pytest.TempPathFactory) -> Renderer:
    folder = _tokenizer_dir(tmp_path_factory.mktemp("thinking"), THINKING_TEMPLATE)
    return Renderer(folder, chat_template_kwargs={"enable_thinking": False})


@pytest.fixture(scope="module")
def fixture_prompts() -> list[list[dict]]:
    """Real prompts from every fixture file: the first ones and some from the end."""
    prompts = []
    for path in sorted(DATASETS.glob("*/*.json*")):
        # tau-bench keeps its messages under `traj`
        field_map = {"messages": "traj"} if path.name.startswith("tau_bench") else None
        with SourceIndex.build([path]) as index:
            n = len(index)
            picks = sorted({*range(min(n, PROMPTS_PER_FILE // 2)), *range(max(0, n - 20), n)})
            for i in picks:
                try:
                    prompts.append(read_sample(index, i, "auto", "last", None, field_map).prompt)
                except Rejected:  # records that exist to be rejected (tokencap_conversations)
                    continue
    return prompts


def test_qwen_hi_matches_provenance(qwen: Renderer) -> None:
    assert qwen.render(HI) == (QWEN_HI_TEXT, QWEN_HI_IDS)
    assert qwen.eos_token_id == 151645
    assert qwen.vocab_size == 151665
    assert qwen.name == "qwen2.5-instruct"
    assert len(qwen.chat_template_sha256) == 64


def test_qwen_decode_gives_back_the_rendered_text(
    qwen: Renderer, fixture_prompts: list[list[dict]]
) -> None:
    assert len(fixture_prompts) > 150
    for messages in fixture_prompts:
        text, ids = qwen.render(messages)
        assert qwen.decode(ids) == text
        assert ids[-3:] == [151644, 77091, 198]  # <|im_start|>assistant\n
        assert text.count("<|im_start|>") == ids.count(151644)


def test_render_many_equals_render_one_by_one(
    qwen: Renderer, fixture_prompts: list[list[dict]]
) -> None:
    assert qwen.render_many(fixture_prompts) == [qwen.render(m) for m in fixture_prompts]
    assert qwen.render_many([]) == []


def test_system_prompt_replaces_the_default_qwen_system(qwen: Renderer) -> None:
    path = DATASETS / "sharegpt" / "torchtune_chat_tiny.json"
    with SourceIndex.build([path]) as index:
        own = read_sample(index, 0, "auto", "first", None).prompt
        replaced = read_sample(index, 0, "auto", "first", "You are terse.").prompt
    own_text, _ = qwen.render(own)
    text, ids = qwen.render(replaced)
    assert own_text.startswith("<|im_start|>system\nYou are an AI assistant.<|im_end|>\n")
    assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\n")
    assert "You are Qwen" not in text and "You are an AI assistant" not in text
    assert qwen.decode(ids) == text


def test_chat_template_kwargs_switch_thinking(thinking: Renderer) -> None:
    off_text, off_ids = thinking.render(HI)
    on_text, on_ids = thinking.render(HI, extra_kwargs={"enable_thinking": True})
    assert off_text == on_text + "<think>\n\n</think>\n\n"
    assert on_text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert off_ids[: len(on_ids)] == on_ids and len(off_ids) > len(on_ids)
    assert thinking.decode(off_ids) == off_text


def test_template_errors_are_rejected_per_item(thinking: Renderer) -> None:
    bad = [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "hi"}]
    with pytest.raises(Rejected) as info:
        thinking.render(bad)
    assert info.value.reason == "template_error" and info.value.field is None
    assert "must start with a user" in info.value.message
    results = thinking.render_many([HI, bad, HI])
    assert isinstance(results[1], Rejected) and results[1].reason == "template_error"
    assert results[0] == results[2] == thinking.render(HI)


def test_phi3_renders_at_the_token_level(phi3: Renderer, fixture_prompts: list[list[dict]]) -> None:
    text, ids = phi3.render(HI)
    assert (text, ids) == (PHI3_HI_TEXT, PHI3_HI_IDS)
    assert phi3.decode(ids) == "<|user|>hi<|end|><|assistant|>"  # newlines swallowed
    encode = phi3.tokenizer
    for messages in fixture_prompts[::5]:
        text, ids = phi3.render(messages)
        assert encode(phi3.decode(ids), add_special_tokens=False)["input_ids"] == ids
        squeezed = text
        for special in PHI3_SPECIALS:
            squeezed = squeezed.replace(special + "\n", special)
        assert phi3.decode(ids) == squeezed
        assert ids[-1] == 32001 and ids[0] in (32006, 32010)  # <|system|> or <|user|>


def test_missing_or_unusable_tokenizer_is_a_tokenizer_error(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-tokenizer"
    with pytest.raises(TokenizerError, match="no-such-tokenizer"):
        Renderer(missing)
    empty = tmp_path / "empty-dir"
    empty.mkdir()
    with pytest.raises(TokenizerError, match="empty-dir") as info:
        Renderer(empty)
    assert "Traceback" not in str(info.value) and "\n" not in str(info.value)
    bare = _tokenizer_dir(tmp_path, chat_template=None)
    with pytest.raises(TokenizerError, match="no chat template"):
        Renderer(bare)
    assert issubclass(TokenizerError, ValueError)
    assert issubclass(TokenizerError, TokencapError)


def test_developer_becomes_system_unless_the_template_knows_it(qwen: Renderer) -> None:
    messages = [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "hi"}]
    assert qwen.knows_role("developer") is False
    text = qwen.render_text(messages)
    assert text == qwen.render_text([{"role": "system", "content": "Be terse."}, messages[1]])
    qwen._developer = True  # a template that knows the role gets it as is
    try:
        assert qwen.prepare(messages) == messages
    finally:
        qwen._developer = None


def test_a_folder_without_tokenizer_files_says_so_in_one_sentence(tmp_path) -> None:
    from producer.render import Renderer, TokenizerError

    with pytest.raises(TokenizerError) as err:
        Renderer(tmp_path)
    assert "no tokenizer file in it" in str(err.value) and "tokenizer.json" in str(err.value)
    assert str(err.value).endswith("tokenizer files")  # whole, not cut after "one of:"
