"""`tokencap init` (`tokencap/prepare/init.py`): a config from the data files alone, which the plan
accepts as it is."""

from __future__ import annotations

import json

from click.testing import CliRunner

from foundation.config import load_config
from tests.conftest import DATASETS, QWEN
from tokencap.cli.main import main
from tokencap.cli.offline import plan_cmd

FILES = [DATASETS / "question_answer" / "gsm8k_test_first200.jsonl",
         DATASETS / "sharegpt" / "fastchat_dummy_conversation.json",
         DATASETS / "alpaca" / "llamafactory_alpaca_en_demo.json"]


def test_init_writes_a_config_plan_check_accepts(tmp_path) -> None:
    dest = tmp_path / "run.toml"
    res = CliRunner().invoke(main, ["init", *map(str, FILES), "--tokenizer", str(QWEN),
                                    "--out", str(dest), "--cap", "50000"])
    assert res.exit_code == 0, res.output
    cfg = load_config(dest)
    assert [(c.format, c.cap_tokens) for c in cfg.category] == [
        ("question_answer", 50000), ("sharegpt", 50000), ("alpaca", 50000)]
    text = dest.read_text()
    assert "gsm8k_test_first200: 200 records" in text and "prompt tokens" in text
    assert "temperature 0.7" in text  # the model's own sampling, said where it comes from
    res = CliRunner().invoke(plan_cmd, [str(dest), "--check", "--json"])
    assert res.exit_code == 0, res.output
    rows = {r["category"]: r for r in json.loads(res.stdout)["categories"]}
    assert rows["gsm8k_test_first200"]["checked"]["usable"] == 200


def test_init_says_what_it_cannot_tell_and_refuses_to_overwrite(tmp_path) -> None:
    odd = tmp_path / "odd.jsonl"
    odd.write_text('{"instr": "Write a haiku.", "n": 1}\n')
    dest = tmp_path / "run.toml"
    res = CliRunner().invoke(main, ["init", str(odd), "--tokenizer", str(QWEN), "--out",
                                    str(dest)])
    assert res.exit_code == 0, res.output
    # no format fits: the map that reads it is written as a setting, not a comment
    assert '\nfield_map = { prompt = "instr" }' in dest.read_text()
    assert "none fits: field_map" in res.output
    again = CliRunner().invoke(main, ["init", str(odd), "--tokenizer", str(QWEN), "--out",
                                      str(dest)])
    assert again.exit_code == 2 and "--force" in again.output
    gone = CliRunner().invoke(main, ["init", str(tmp_path / "nope.jsonl"), "--tokenizer",
                                     str(QWEN), "--out", str(tmp_path / "x.toml")])
    assert gone.exit_code == 2 and "Traceback" not in gone.output


def test_init_tells_records_of_a_preset_s_dataset_and_plan_check_accepts_them(tmp_path) -> None:
    presets = DATASETS / "presets"
    files = [presets / "ultrachat" / "speculators_ultrachat_messages.jsonl",
             presets / "hermes" / "hermes_function_calling_v1_card_examples.json",
             presets / "magpie" / "magpie_repo_example_instructions.jsonl"]
    dest = tmp_path / "run.toml"
    res = CliRunner().invoke(main, ["init", *map(str, files), "--tokenizer",
                                    str(DATASETS.parent / "tokenizers" / "qwen3"),
                                    "--out", str(dest)])
    assert res.exit_code == 0, res.output
    cfg = load_config(dest)
    assert [c.preset for c in cfg.category] == ["ultrachat", "hermes", "magpie"]
    res = CliRunner().invoke(plan_cmd, [str(dest), "--check", "--json"])
    assert res.exit_code == 0, res.output
    usable = {r["category"]: r["checked"]["usable"] for r in json.loads(res.stdout)["categories"]}
    assert list(usable.values()) == [1, 4, 5]


def test_init_reads_past_a_bad_record_and_configures_the_files_it_can_read(tmp_path) -> None:
    """Of three files, one with a bad line among good records (skipped, named file:line),
    one whose records are all unreadable (left out, named, exit 2), and a CSV: the config
    holds the two readable ones and passes `plan --check` as written."""
    good = tmp_path / "qa.jsonl"
    good.write_text('{"question": "What is 2+2?"}\n{"question": oops}\n'
                    '{"question": "Name a prime."}\n')
    bad = tmp_path / "broken.jsonl"
    bad.write_bytes(b'{"question": "caf\xe9"}\n{not json\n')
    csv = tmp_path / "prompts.csv"
    csv.write_text('prompt,source\n"Write a haiku\nabout rain",poems\n')
    dest = tmp_path / "run.toml"
    res = CliRunner().invoke(main, ["init", str(good), str(bad), str(csv), "--tokenizer",
                                    str(QWEN), "--out", str(dest), "--cap", "1.5M"])
    assert res.exit_code == 2, res.output
    assert f"skipped {good}:2: invalid_json" in res.output
    assert f"{bad}:1: invalid_utf8" in res.output.splitlines()[-1]  # the one error line
    cfg = load_config(dest)
    assert [c.name for c in cfg.category] == ["qa", "prompts"]
    assert all(cfg.cap_for(c) == 1_500_000 for c in cfg.category)
    assert "text in source is never sent" in res.output  # the CSV's other column, named
    check = CliRunner().invoke(plan_cmd, [str(dest), "--check", "--json"])
    assert check.exit_code == 0, check.output
    usable = {r["category"]: r["checked"]["usable"] for r in json.loads(check.stdout)[
        "categories"]}
    assert usable == {"qa": 2, "prompts": 1}


def test_init_on_agent_trajectories_under_traj_writes_a_map_plan_check_takes_as_written(
        tmp_path) -> None:
    """Agent trajectories under `"traj"` with ShareGPT's human/gpt/function_call/observation
    roles fit no format by name: init writes the field_map that reads them as a setting, and
    the config passes `plan --check` without an edit."""
    steps = [("system", "You book flights."), ("human", "Book LHR to JFK."),
             ("function_call", '{"name": "search", "arguments": {"to": "JFK"}}'),
             ("observation", '[{"flight": "BA117"}]'), ("gpt", "Booked BA117.")]
    src = tmp_path / "agent.jsonl"
    src.write_text("".join(json.dumps({"id": i, "traj": [{"from": f, "value": v}
                                                          for f, v in steps]}) + "\n"
                           for i in range(3)))
    dest = tmp_path / "run.toml"
    res = CliRunner().invoke(main, ["init", str(src), "--tokenizer", str(QWEN), "--out",
                                    str(dest)])
    assert res.exit_code == 0, res.output
    assert 'field_map = { messages = "traj", role = "from", content = "value" }' in (
        dest.read_text())
    check = CliRunner().invoke(plan_cmd, [str(dest), "--check", "--json"])
    assert check.exit_code == 0, check.output
    [row] = json.loads(check.stdout)["categories"]
    assert row["checked"]["usable"] == 3
