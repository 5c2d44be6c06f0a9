"""`tokencap plan` and `tokencap preview`: numbers worked by hand, and real fixture renders."""

from __future__ import annotations

import json
import math
from pathlib import Path

import msgspec
import pytest
from click.testing import CliRunner

from foundation.config import load_config
from foundation.wire import Result
from producer.readers.index import SourceIndex, read_sample, shuffled_order
from producer.render import Renderer
from tests.conftest import DATASETS, QWEN
from tokencap.cli.offline import plan_cmd, preview_cmd
from tokencap.prepare.plan import (
    PROMPT_SAMPLE_SIZE,
    RECIPES,
    Measured,
    plan,
    preview,
    totals,
)

GSM8K = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"
SHAREGPT = DATASETS / "sharegpt" / "fastchat_dummy_conversation.json"
SYSTEM = "You answer in one line."
SEED = 11


def _config(tmp_path: Path, head: str = "", cats: str | None = None) -> Path:
    cats = cats if cats is not None else (
        f'[[category]]\nname = "math"\nsource = "{GSM8K}"\nformat = "question_answer"\n'
        f"expected_tokens = 400\ncap_tokens = 100000\n"
        f"sampling = {{ max_new_tokens = 1024, temperature = 0.7 }}\n\n"
        f'[[category]]\nname = "chat"\nsource = "{SHAREGPT}"\nformat = "sharegpt"\n'
        f'turns = "last"\nsystem_prompt = "{SYSTEM}"\ncap_tokens = 20000\n'
        f"sampling = {{ max_new_tokens = 256 }}\n"
    )
    path = tmp_path / "run.toml"
    path.write_text(f'run = "p"\noutput_dir = "{tmp_path / "out"}"\ntokenizer = "{QWEN}"\n'
                    f"seed = {SEED}\n{head}\n{cats}", encoding="utf-8")
    return path


def _one_cat(tmp_path: Path, cap: int, expected: int, head: str = "") -> Path:
    return _config(tmp_path, head, (
        f'[[category]]\nname = "a"\nsource = "{GSM8K}"\ncap_tokens = {cap}\n'
        f"expected_tokens = {expected}\nsampling = {{ max_new_tokens = 4096 }}\n"))


def _records(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


# -- plan(): numbers worked by hand ------------------------------------------------------


def test_cap_over_average_gives_the_samples(tmp_path):
    cfg = load_config(_one_cat(tmp_path, 10_000_000, 2_500))
    [row] = plan(cfg, available={"a": 10_000}, tok_s=1_000)
    assert (row.samples, row.total_tokens, row.limited_by) == (4_000, 10_000_000, "cap")
    assert (row.avg_tokens, row.source) == (2_500, "estimate")
    assert row.hours == pytest.approx(10_000_000 / 1_000 / 3_600)  # 2.777... h


def test_too_few_prompts_bound_the_samples_and_tokens(tmp_path):
    cfg = load_config(_one_cat(tmp_path, 10_000_000, 2_500))
    [row] = plan(cfg, available={"a": 3_000}, tok_s=1_000)
    assert (row.samples, row.total_tokens, row.limited_by) == (3_000, 7_500_000, "prompts")
    assert row.hours == pytest.approx(2.0833, abs=1e-4)
    [fast] = plan(cfg, available={"a": 3_000}, tok_s=2_000)
    assert fast.hours == pytest.approx(row.hours / 2)


def test_a_partial_last_sample_rounds_up_and_unknown_prompts_do_not_bound(tmp_path):
    cfg = load_config(_one_cat(tmp_path, 10_000, 3_000))
    [row] = plan(cfg)
    assert (row.samples, row.total_tokens, row.prompts) == (4, 10_000, None)


def test_measured_average_overrides_the_estimate(tmp_path):
    cfg = load_config(_one_cat(tmp_path, 10_000_000, 2_500))
    done = Measured(samples=10, counted_tokens=12_000, output_tokens=12_000, prompt_tokens=900)
    [row] = plan(cfg, measured={"a": done}, available={"a": 100_000}, tok_s=1_000)
    assert (row.avg_tokens, row.source) == (1_200, "measured")
    assert row.samples == math.ceil(10_000_000 / 1_200) == 8_334
    assert (row.done_samples, row.done_tokens) == (10, 12_000)
    assert row.hours_left == pytest.approx((10_000_000 - 12_000) / 1_000 / 3_600)
    [empty] = plan(cfg, measured={"a": Measured(0, 0, 0)}, available={"a": 100_000})
    assert empty.source == "estimate"


def test_count_total_adds_prompt_tokens_but_hours_follow_output(tmp_path):
    cfg = load_config(_one_cat(tmp_path, 600_000, 500, head='count = "total"'))
    [row] = plan(cfg, available={"a": 5_000}, tok_s=1_000, prompt_tokens={"a": 100.0})
    assert (row.avg_tokens, row.avg_output_tokens) == (600, 500)
    assert (row.samples, row.total_tokens, row.output_tokens) == (1_000, 600_000, 500_000)
    assert row.hours == pytest.approx(500_000 / 1_000 / 3_600)


def test_totals_add_up(tmp_path):
    cfg = load_config(_config(tmp_path))
    rows = plan(cfg, available={"math": 200, "chat": 10}, tok_s=1_000)
    math_row, chat_row = rows
    assert (math_row.samples, math_row.total_tokens) == (200, 80_000)  # 200 x 400 < 100,000
    assert (chat_row.samples, chat_row.total_tokens) == (10, 2_560)  # expected = max_new 256
    total = totals(rows)
    assert (total.category, total.samples, total.total_tokens) == ("total", 210, 82_560)
    assert total.prompts == 210
    assert total.hours == pytest.approx(82_560 / 1_000 / 3_600)


# -- plan CLI -----------------------------------------------------------------------------


def test_plan_cli_counts_prompts_and_switches_to_measured(tmp_path):
    cfg = _config(tmp_path)
    runner = CliRunner()
    res = runner.invoke(plan_cmd, [str(cfg), "--json", "--tok-s", "500"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rows = {r["category"]: r for r in doc["categories"]}
    assert rows["math"]["prompts"] == _records(GSM8K) == 200
    with SourceIndex.build([SHAREGPT]) as index:
        assert rows["chat"]["prompts"] == len(index)
    assert (rows["math"]["source"], rows["math"]["avg_tokens"]) == ("estimate", 400)
    assert rows["math"]["samples"] == 200  # 100,000 / 400 = 250 > 200 prompts
    assert doc["total"]["samples"] == rows["math"]["samples"] + rows["chat"]["samples"]
    assert doc["tok_s"] == 500

    part = tmp_path / "out" / "math" / "part-00000.jsonl"
    part.parent.mkdir(parents=True)
    lines = [msgspec.json.encode(Result(
        id=f"g:{i}", category="math", prompt_ids=[1] * 50, output_ids=[2] * c, prompt_tokens=50,
        completion_tokens=c, finish_reason="stop", text="", sampling={}, counted_tokens=c))
        for i, c in enumerate((900, 1_100))]
    part.write_bytes(b"\n".join(lines) + b"\ntorn")
    res = runner.invoke(plan_cmd, [str(cfg), "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["category"]: r for r in json.loads(res.stdout)["categories"]}
    assert (rows["math"]["source"], rows["math"]["avg_tokens"]) == ("measured", 1_000)
    assert (rows["math"]["samples"], rows["math"]["done_samples"]) == (100, 2)
    assert rows["chat"]["source"] == "estimate"

    res = runner.invoke(plan_cmd, [str(cfg)])
    assert res.exit_code == 0, res.output
    lines = res.stdout.splitlines()
    assert lines[0].split()[:6] == ["category", "cap", "prompts", "tok/row", "from", "rows"]
    math_line = next(line for line in lines if line.startswith("math "))
    assert "100,000" in math_line and "measured" in math_line
    total_line = next(line for line in lines if line.startswith("total "))
    total_rows = int(total_line.split()[4].replace(",", ""))  # no "from" in the total
    recipes = next(line for line in lines if "published drafter recipes" in line)
    assert recipes.startswith(f"{total_rows:,} rows")
    assert f"{100 * total_rows / 500_000:.2g}% of 500,000" in recipes
    assert "vllm-project/speculators#751" in recipes


def test_plan_json_places_the_rows_against_the_published_recipes(tmp_path):
    res = CliRunner().invoke(plan_cmd, [str(_config(tmp_path)), "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    rows = doc["total"]["samples"]
    assert rows == sum(r["samples"] for r in doc["categories"]) > 0
    assert [r["rows"] for r in doc["recipes"]] == [n for n, _what, _src in RECIPES]
    assert [r["share"] for r in doc["recipes"]] == [rows / n for n, _what, _src in RECIPES]


def test_plan_cli_with_count_total_renders_prompts_to_estimate(tmp_path):
    cfg_path = _config(tmp_path, head='count = "total"')
    res = CliRunner().invoke(plan_cmd, [str(cfg_path), "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["category"]: r for r in json.loads(res.stdout)["categories"]}
    cfg = load_config(cfg_path)
    renderer = Renderer(QWEN)
    with SourceIndex.build([GSM8K]) as index:
        order = shuffled_order(len(index), SEED)[:PROMPT_SAMPLE_SIZE]
        lengths = [len(renderer.render(read_sample(index, i, "question_answer", "first",
                                                   None).prompt)[1]) for i in order]
    expected = cfg.expected_for(cfg.by_name("math")) + sum(lengths) / len(lengths)
    assert rows["math"]["avg_tokens"] == pytest.approx(expected)
    assert rows["math"]["avg_output_tokens"] == 400


@pytest.mark.parametrize("check", [False, True])
def test_plan_opens_each_categorys_sources_once(tmp_path, monkeypatch, check):
    """Counting, checking and the prompt-length estimate share one pass per category."""
    from producer.source import CategorySource

    opened: list[str] = []
    real = CategorySource.open.__func__  # type: ignore[attr-defined]

    def counting(cls, cfg, cat, *args, **kwargs):
        opened.append(cat.name)
        return real(cls, cfg, cat, *args, **kwargs)

    monkeypatch.setattr(CategorySource, "open", classmethod(counting))
    cfg_path = _config(tmp_path, head='count = "total"')
    res = CliRunner().invoke(plan_cmd, [str(cfg_path), "--json", *(["--check"] if check else [])])
    assert res.exit_code == 0, res.output
    assert sorted(opened) == ["chat", "math"]
    rows = {r["category"]: r for r in json.loads(res.stdout)["categories"]}
    assert rows["math"]["avg_tokens"] > rows["math"]["avg_output_tokens"]  # the prompt counted


def test_plan_cli_bad_config_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('run = "x"\noutput_dir = "o"\n', encoding="utf-8")
    res = CliRunner().invoke(plan_cmd, [str(bad)])
    assert res.exit_code == 2
    assert "no [[category]]" in res.stderr
    assert "Traceback" not in res.output


# -- preview ------------------------------------------------------------------------------


def test_preview_renders_the_first_shuffled_prompt(tmp_path):
    cfg = load_config(_config(tmp_path, head="context_length = 300"))
    renderer = Renderer(QWEN)
    [math_p, chat_p] = preview(cfg, renderer=renderer)
    with SourceIndex.build([GSM8K]) as index:
        first = read_sample(index, shuffled_order(len(index), SEED)[0], "question_answer",
                            "first", None)
    assert (math_p.sample_id, math_p.where) == (first.sample_id, first.where)
    assert math_p.messages == first.prompt
    text, ids = renderer.render(first.prompt)
    assert (math_p.text, math_p.prompt_ids) == (text, ids)
    assert math_p.text.endswith("<|im_start|>assistant\n")
    assert math_p.prompt_tokens == len(math_p.prompt_ids)
    assert math_p.prompt_tokens == len(renderer.tokenizer(math_p.text,
                                                          add_special_tokens=False)["input_ids"])
    # the model's generation_config.json completes what the category leaves unset
    # and its end-of-turn ids (<|endoftext|>, <|im_end|>) are the stop ids sent
    model = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05,
             "stop_token_ids": [151643, 151645]}
    assert math_p.sampling == {**model, "max_new_tokens": 1024, "temperature": 0.7}
    assert any("exceeds context_length 300" in w for w in math_p.warnings)
    assert chat_p.text.startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>")
    assert chat_p.sampling == {**model, "max_new_tokens": 256}
    assert len(preview(cfg, n=3, renderer=renderer, categories=["chat"])) == 3


def test_preview_flags_template_kwargs_the_template_never_reads(tmp_path):
    head = "chat_template_kwargs = { enable_thinking = false }"
    cats = (f'[[category]]\nname = "math"\nsource = "{GSM8K}"\n'
            f"chat_template_kwargs = {{ thinking = false }}\n"
            f"sampling = {{ max_new_tokens = 64 }}\n")
    cfg = load_config(_config(tmp_path, head, cats))
    [p] = preview(cfg, renderer=Renderer(QWEN))
    assert p.chat_template_kwargs == {"enable_thinking": False, "thinking": False}
    assert len([w for w in p.warnings if "never read by the template" in w]) == 2
    # the run (and preview from the command line) refuses them, naming the field
    res = CliRunner().invoke(preview_cmd, [str(_config(tmp_path, head, cats))])
    assert res.exit_code == 2
    assert "$.chat_template_kwargs.enable_thinking" in res.output
    assert "never reads `enable_thinking`" in res.output


def test_preview_cli_shows_text_count_and_sampling(tmp_path):
    cfg = _config(tmp_path)
    res = CliRunner().invoke(preview_cmd, [str(cfg), "--category", "math"])
    assert res.exit_code == 0, res.output
    [p] = preview(load_config(cfg), categories=["math"])
    assert p.text in res.stdout
    assert f"prompt tokens: {p.prompt_tokens}" in res.stdout
    assert '"max_new_tokens":1024' in res.stdout
    assert "=== chat" not in res.stdout

    res = CliRunner().invoke(preview_cmd, [str(cfg), "--json", "-n", "2"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [d["category"] for d in doc] == ["math", "math", "chat", "chat"]
    assert msgspec.to_builtins(p) == doc[0]

    res = CliRunner().invoke(preview_cmd, [str(cfg), "--category", "nope"])
    assert res.exit_code == 1
    assert "no category 'nope'" in res.stderr


def test_preview_exits_2_when_a_category_has_no_usable_record(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": []}\n{"messages": [{"role": "user", "content": 5}]}\n')
    cfg = _config(tmp_path, cats=f'[[category]]\nname = "bad"\nsource = "{bad}"\n'
                  'cap_tokens = 100\nsampling = { max_new_tokens = 8 }\n')
    res = CliRunner().invoke(preview_cmd, [str(cfg)])
    assert res.exit_code == 2, res.output
    assert "no usable record in category bad" in res.stderr
    assert "bad.jsonl:1" in res.output and "bad.jsonl:2" in res.output  # why, file:line


CONVERSATIONS = DATASETS / "conversations" / "tokencap_conversations.jsonl"


def test_an_uncapped_category_plans_its_whole_source(tmp_path):
    cfg = load_config(_config(tmp_path, cats=(
        f'[[category]]\nname = "math"\nsource = "{GSM8K}"\nexpected_tokens = 400\n'
        f'cap_tokens = "none"\nsampling = {{ max_new_tokens = 1024 }}\n')))
    [row] = plan(cfg, available={"math": 200}, tok_s=1000.0)
    assert (row.cap_tokens, row.samples, row.limited_by) == (None, 200, "prompts")
    assert row.total_tokens == 200 * 400
    assert totals([row]).cap_tokens is None
    res = CliRunner().invoke(plan_cmd, [str(tmp_path / "run.toml")])
    assert res.exit_code == 0, res.output
    assert "uncapped" in res.stdout and "10000000" not in res.stdout.replace(",", "")


def test_plan_check_counts_usable_records_and_their_turns(tmp_path):
    path = _config(tmp_path, cats=(
        f'[[category]]\nname = "conv"\nsource = "{CONVERSATIONS}"\nturns = "all"\n'
        f'role_map = {{ customer = "user", agent = "assistant" }}\ncap_tokens = "none"\n'
        f"sampling = {{ max_new_tokens = 64 }}\n"))
    res = CliRunner().invoke(plan_cmd, [str(path), "--check", "--json"])
    assert res.exit_code == 0, res.output
    [row] = json.loads(res.stdout)["categories"]
    # 8 records: 3 rejected for a reason each; the 5 others ask for 3+2+4+2+2 generations
    examples = row["checked"].pop("examples")
    assert row["checked"] == {"records": 8, "usable": 5, "generations": 13, "rejected": {
        "invalid_json": 1, "no_user_turn": 1, "unknown_role": 1}, "unread": {},
        "contaminated": {}}
    # each reject named where it is: file:line (field)
    assert examples["invalid_json"] == [
        f"{CONVERSATIONS}:8: invalid_json (messages[1].tool_calls[0].function.arguments): not "
        "valid JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
        "(char 1)"]
    assert set(examples) == set(row["checked"]["rejected"])
    assert row["prompts"] == row["samples"] == 13
    table = CliRunner().invoke(plan_cmd, [str(path), "--check"]).stdout
    assert "conv: 5 of 8 records usable, 13 generations; rejected: invalid_json 1" in table


# -- records whose tool results answer no call -------------------------------------------

ORPHANS = [  # (what is wrong, the record) one a line
    ("a result before any assistant turn", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "tool", "tool_call_id": "c1", "content": "12C"},
        {"role": "assistant", "content": "12C."}]}),
    ("a result before the first user turn", {"messages": [
        {"role": "tool", "content": "12C"}, {"role": "user", "content": "hi"}]}),
    ("more results than calls", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "12C"},
        {"role": "tool", "tool_call_id": "c1", "content": "14C"}]}),
    ("an id no call has", {"messages": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c9", "content": "12C"}]}),
]
GOOD = {"messages": [
    {"role": "user", "content": "hi"},
    # calls written in the text (no structured calls): what its results answer is not told
    {"role": "assistant", "content": "<tool_call>{\"name\": \"f\"}</tool_call>"},
    {"role": "tool", "content": "12C"}, {"role": "assistant", "content": "12C."}]}


def _check_agent(tmp_path: Path, src: Path, turns: str, usable: int) -> list[str]:
    """`plan --check` of one category: its usable count, and the rejects it shows."""
    path = _config(tmp_path, cats=(
        f'[[category]]\nname = "agent"\nsource = "{src}"\nturns = "{turns}"\n'
        f"sampling = {{ max_new_tokens = 64 }}\n"))
    res = CliRunner().invoke(plan_cmd, [str(path), "--check"])
    assert res.exit_code == 0, res.output
    assert f"agent: {usable} of 5 records usable" in res.stdout
    assert f"rejected: orphan_tool_result {5 - usable}" in res.stdout
    return [line.strip() for line in res.stdout.splitlines() if "orphan_tool_result (" in line]


def test_plan_check_refuses_tool_results_that_answer_no_call(tmp_path) -> None:
    src = tmp_path / "agent.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for _, r in ORPHANS) + json.dumps(GOOD) + "\n")
    # the first three of a reason, each named by file:line and field
    first, second, third = _check_agent(tmp_path, src, "all", usable=1)
    assert first.startswith(f"{src}:1: orphan_tool_result (messages[1]): a tool result before "
                            "any assistant turn")
    assert second.startswith(f"{src}:2: orphan_tool_result (messages[0]): a tool result "
                             "before the first user turn")
    assert third.startswith(f"{src}:3: orphan_tool_result (messages[3]): tool result 2 after "
                            "an assistant turn that made 1 call(s)")
    # "first" renders the conversation up to its first user turn: only what comes before it
    assert _check_agent(tmp_path, src, "first", usable=4) == [second]


def test_plan_check_counts_what_the_intake_screens_would_refuse(tmp_path) -> None:
    # Given GSM8K test questions with GSM8K decontaminated, and MATH-Minerva problems, two
    # pairs of which are near copies (subproblem chains)
    path = _config(tmp_path, head='decontaminate = ["gsm8k", "mt_bench"]', cats=(
        f'[[category]]\nname = "qa"\nsource = "{DATASETS}/question_answer/'
        'gsm8k_test_first200.jsonl"\nsampling = { max_new_tokens = 64 }\n'
        f'[[category]]\nname = "math"\nsource = "{DATASETS}/problem_solution/'
        'qwen25math_minerva_math_test.jsonl"\nsampling = { max_new_tokens = 64 }\n'))
    res = CliRunner().invoke(plan_cmd, [str(path), "--check", "--json"])
    # Then plan --check counts each category's losses, by benchmark
    rows = {r["category"]: r["checked"] for r in json.loads(res.stdout)["categories"]}
    assert rows["qa"]["rejected"] == {"contaminated": 200}
    assert rows["qa"]["contaminated"] == {"gsm8k": 200} and rows["qa"]["usable"] == 0
    assert rows["math"]["rejected"] == {"near_duplicate": 2} and rows["math"]["usable"] == 270
    assert res.exit_code != 0  # qa has no usable record left


def test_plan_check_fails_when_a_category_has_no_usable_record(tmp_path) -> None:
    src = tmp_path / "agent.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for _, r in ORPHANS))
    path = _config(tmp_path, cats=(
        f'[[category]]\nname = "agent"\nsource = "{src}"\nturns = "all"\n'
        f"sampling = {{ max_new_tokens = 64 }}\n"))
    res = CliRunner().invoke(plan_cmd, [str(path), "--check"])
    assert res.exit_code == 2
    assert f"{path}: no usable record in category agent" in res.output
    assert "Traceback" not in res.output


def test_plan_check_holds_prompts_to_the_models_own_context_without_context_length(tmp_path):
    import shutil

    tok = tmp_path / "tok"
    shutil.copytree(QWEN, tok)
    src = tmp_path / "long.jsonl"
    src.write_text(json.dumps({"prompt": "word " * 3000}) + "\n"
                   + json.dumps({"prompt": "short"}) + "\n")
    cats = (f'[[category]]\nname = "c"\nsource = "{src}"\ncap_tokens = 100\n'
            "sampling = { max_new_tokens = 16, temperature = 0.7 }\n")
    cfg = tmp_path / "run.toml"
    cfg.write_text(f'run = "p"\noutput_dir = "{tmp_path / "out"}"\ntokenizer = "{tok}"\n{cats}')
    res = CliRunner().invoke(plan_cmd, [str(cfg), "--check", "--json"])
    assert res.exit_code == 0, res.output
    assert "prompts are not checked against the engine's context" in res.stderr
    (tok / "config.json").write_text(json.dumps({"model_type": "qwen2",
                                                 "max_position_embeddings": 1024}))
    res = CliRunner().invoke(plan_cmd, [str(cfg), "--check", "--json"])
    assert res.exit_code == 0, res.output
    assert "context of 1,024 tokens (the model's config.json" in res.stderr
    [row] = json.loads(res.stdout)["categories"]
    assert row["checked"]["usable"] == 1 and "prompt_too_long" in row["checked"]["rejected"]


QWEN3 = QWEN.parent / "qwen3"
MODES = ('modes = [{ name = "think", weight = 0.7, chat_template_kwargs = { enable_thinking = '
         'true } }, { name = "fast", weight = 0.3, chat_template_kwargs = { enable_thinking = '
         'false }, sampling = { temperature = 0.6 } }]')


@pytest.mark.parametrize("share", ["conversation", "tokens"])
def test_preview_shows_one_prompt_per_mode(tmp_path, share):
    from foundation import modes

    path = tmp_path / "modes.toml"
    path.write_text(f'run = "p"\noutput_dir = "{tmp_path / "out"}"\ntokenizer = "{QWEN3}"\n'
                    f'cap_tokens = 10000\n[[category]]\nname = "math"\nsource = "{GSM8K}"\n'
                    f'sampling = {{ max_new_tokens = 64, temperature = 0.9 }}\nshare = "{share}"\n'
                    f'{MODES}\n')
    cfg = load_config(path)
    renderer = Renderer(QWEN3)
    think, fast = preview(cfg, renderer=renderer)
    assert (think.mode, fast.mode) == ("think", "fast")
    assert think.chat_template_kwargs == {"enable_thinking": True}
    assert (think.sampling["temperature"], fast.sampling["temperature"]) == (0.9, 0.6)
    # each is the first record drawn to its mode, rendered with the mode's switch
    family = cfg.category[0]
    for p in (think, fast):
        drawn = modes.draw(cfg, family, p.sample_id)
        assert drawn is not None and drawn.name == p.mode
        assert p.text == renderer.render(p.messages, p.chat_template_kwargs)[0]
    assert fast.text.endswith("<think>\n\n</think>\n\n")
    assert not think.text.endswith("</think>\n\n")
    res = CliRunner().invoke(preview_cmd, [str(path), "--category", "math"])
    assert res.exit_code == 0, res.output
    assert "· mode think ·" in res.stdout and "· mode fast ·" in res.stdout
