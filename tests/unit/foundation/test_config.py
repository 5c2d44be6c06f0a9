"""Config errors name the file and the field; the CLI prints them without a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from foundation.config import RunConfig, load_config
from foundation.errors import ConfigError
from tests.conftest import DATASETS, QWEN, write_config

SRC = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"


def base(extra: str = "", cat_extra: str = "", sampling: str = "max_new_tokens = 128") -> str:
    return f"""
run = "c"
output_dir = "out"
tokenizer = "{QWEN}"
{extra}
[[category]]
name = "qa"
source = "{SRC}"
sampling = {{ {sampling} }}
{cat_extra}
"""


@pytest.mark.parametrize("extra,cat_extra,sampling,field", [
    ("bogus = 1", "", "max_new_tokens = 1", "bogus"),
    ("", "cap_tokens = -5", "max_new_tokens = 1", "$.category[0].cap_tokens"),
    ("cap_tokens = 'lots'", "", "max_new_tokens = 1", "$.cap_tokens"),
    ("", "format = 'csv'", "max_new_tokens = 1", "$.category[0].format"),
    ("", "", "temperature = 0.5", "max_new_tokens"),
    ("", "", "max_new_tokens = 8, logprobs = 1", "logprobs"),
    ("", "", "max_new_tokens = 0", "$.category[0].sampling.max_new_tokens"),
    ("count = 'input'", "", "max_new_tokens = 1", "$.count"),
    ("heartbeat_s = 0", "", "max_new_tokens = 1", "$.heartbeat_s"),
    ("decontaminate = ['mmlu']", "", "max_new_tokens = 1", "$.decontaminate[0]"),
    ("decontaminate = ['gsm8k', 'evals/nope.jsonl']", "", "max_new_tokens = 1",
     "$.decontaminate[1]"),
    ("decontaminate = ['gsm8k', 'gsm8k']", "", "max_new_tokens = 1", "$.decontaminate"),
    ("decontaminate_ngram = 0", "", "max_new_tokens = 1", "$.decontaminate_ngram"),
    ("[near_duplicates]\nthreshold = 1.5", "", "max_new_tokens = 1",
     "$.near_duplicates.threshold"),
    ("[near_duplicates]\nthreshhold = 0.7", "", "max_new_tokens = 1", "`threshold`"),
])
def test_bad_fields_are_named(tmp_path, extra, cat_extra, sampling, field) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(base(extra, cat_extra, sampling))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(path) in str(err.value)
    assert field in str(err.value)


def test_decontaminate_takes_shipped_names_and_files(tmp_path) -> None:
    own = tmp_path / "evals" / "mine.jsonl"
    own.parent.mkdir()
    own.write_text('{"question": "q"}\n')
    path = tmp_path / "c.toml"
    path.write_text(base("decontaminate = ['humaneval', 'evals/mine.jsonl']"))
    cfg = load_config(path)
    assert cfg.decontaminate == ["humaneval", str(own)]
    assert cfg.near_duplicates.enabled and cfg.near_duplicates.threshold == 0.8
    assert cfg.near_duplicates.ngram == 5 and cfg.decontaminate_ngram == 13


def test_missing_source_file_is_named(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(base().replace(str(SRC), str(tmp_path / "nope.jsonl")))
    with pytest.raises(ConfigError, match="nope.jsonl"):
        load_config(path)


def test_unreadable_tokenizer_path_is_named(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(base().replace(str(QWEN), str(tmp_path / "tok")))
    with pytest.raises(ConfigError, match=r"\$\.tokenizer"):
        load_config(path)


def test_invalid_toml(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text("run = \n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(path)


def test_relative_paths_resolve_against_the_config(tmp_path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "x.jsonl").write_text('{"question": "q"}\n')
    path = tmp_path / "c.toml"
    path.write_text(base().replace(str(SRC), "data/x.jsonl"))
    cfg = load_config(path)
    assert cfg.category[0].paths == [str(tmp_path / "data" / "x.jsonl")]
    assert cfg.output_dir == str(tmp_path / "out")
    assert cfg.cap_for(cfg.category[0]) == 10_000_000


def test_cli_reports_config_error_without_traceback(tmp_path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(base("", "cap_tokens = -1"))
    proc = subprocess.run([sys.executable, "-m", "tokencap.cli", "run", str(path),
                           "--redis-url", "redis://127.0.0.1:1/0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "cap_tokens" in proc.stderr and str(path) in proc.stderr
    assert "Traceback" not in proc.stderr


def test_job_timeout_covers_the_http_retry_budget() -> None:
    from foundation.config import Category, RunConfig, SamplingParams

    cfg = RunConfig(run="r", output_dir="o", read_timeout_s=600, connect_timeout_s=3,
                    http_retries=5, backoff_max_s=30,
                    category=[Category(name="a", sources=["x"],
                                       sampling=SamplingParams(max_new_tokens=1))])
    worst = (cfg.http_retries + 1) * (cfg.connect_timeout_s + cfg.read_timeout_s) \
        + cfg.http_retries * cfg.backoff_max_s
    assert cfg.job_timeout_s() > worst


@pytest.mark.parametrize("lease_s,heartbeat_s,beat", [(30.0, 2.0, 2.0), (3.0, 2.0, 1.0),
                                                      (3.0, 0.25, 0.25)])
def test_heartbeat_is_at_most_a_third_of_the_lease(lease_s, heartbeat_s, beat) -> None:
    from consumers.job import RunContext
    from foundation.config import Category, RunConfig, SamplingParams

    cfg = RunConfig(run="r", output_dir="o", lease_s=lease_s, heartbeat_s=heartbeat_s,
                    category=[Category(name="a", sources=["x"],
                                       sampling=SamplingParams(max_new_tokens=1))])
    assert RunContext(None, cfg, ["http://127.0.0.1:1"]).beat_s == pytest.approx(beat)


def test_config_keys_of_conversations(tmp_path) -> None:
    src = tmp_path / "s.jsonl"
    src.write_text('{"question": "q"}\n')

    def config(body: str) -> RunConfig:
        return write_config(tmp_path, f"""
run = "r"
output_dir = "out"
tokenizer = "{QWEN}"
cap_tokens = "none"
[[category]]
name = "c"
source = "{src}"
sampling = {{ max_new_tokens = 8 }}
{body}
""")

    cfg = config('turns = "all"\nrole_map = { bot = "assistant" }')
    cat = cfg.category[0]
    assert (cat.turns, cat.role_map, cfg.cap_for(cat)) == ("all", {"bot": "assistant"}, None)
    assert cfg.cap_for(config("cap_tokens = 500").category[0]) == 500
    with pytest.raises(ConfigError, match=r"role_map.*'robot'"):
        config('role_map = { bot = "robot" }')
    with pytest.raises(ConfigError, match="turns"):
        config('turns = "all"\nformat = "input_ids"')
    with pytest.raises(ConfigError, match="cap_tokens"):
        config('cap_tokens = "lots"')


@pytest.mark.parametrize(("line", "field", "allowed"), [
    ('format = "chatml"', "format", "messages, sharegpt"),
    ('turns = "most"', "turns", "first, last, all"),
])
def test_a_wrong_choice_lists_the_allowed_values(tmp_path, line, field, allowed) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f'run = "x"\noutput_dir = "o"\n[[category]]\nname = "a"\n'
                    f'source = "s.jsonl"\n{line}\ncap_tokens = 5\n'
                    "sampling = { max_new_tokens = 4 }\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert f"$.category[0].{field}" in str(err.value) and allowed in str(err.value)


def test_caps_are_read_as_people_write_them_and_a_bad_one_names_its_field(tmp_path) -> None:
    from foundation.config import load_config
    from foundation.errors import ConfigError

    src = tmp_path / "ids.jsonl"
    src.write_text('{"input_ids": [1, 2]}\n')

    def cfg(run_cap: str, cat_cap: str):
        path = tmp_path / "run.toml"
        path.write_text(f'run = "r"\noutput_dir = "out"\nsampling_defaults = "engine"\n'
                        f"cap_tokens = {run_cap}\n[[category]]\nname = \"a\"\n"
                        f'source = "{src}"\nformat = "input_ids"\ncap_tokens = {cat_cap}\n'
                        "sampling = { max_new_tokens = 8 }\n[[category]]\nname = \"b\"\n"
                        f'source = "{src}"\nformat = "input_ids"\n'
                        "sampling = { max_new_tokens = 8 }\n")
        return load_config(path)

    c = cfg('"10M"', '"1.5k"')
    assert c.cap_for(c.category[0]) == 1_500 and c.cap_for(c.category[1]) == 10_000_000
    c = cfg("2_000", '"none"')
    assert c.cap_for(c.category[0]) is None and c.cap_for(c.category[1]) == 2_000
    with pytest.raises(ConfigError, match=r"\$\.category\[0\]\.cap_tokens: 'lots' is not a "):
        cfg('"10M"', '"lots"')


def test_a_misspelled_key_is_refused_with_the_key_it_meant(tmp_path) -> None:
    from foundation.config import load_config
    from foundation.errors import ConfigError

    path = tmp_path / "run.toml"
    path.write_text('run = "r"\noutput_dir = "out"\n[[category]]\nname = "a"\n'
                    'source = "x.jsonl"\ncap_token = 5\nsampling = { max_new_tokens = 8 }\n')
    with pytest.raises(ConfigError, match="unknown field `cap_token`.*did you mean `cap_tokens`"):
        load_config(path)
    path.write_text('run = "r"\noutputdir = "out"\n')
    with pytest.raises(ConfigError, match="did you mean `output_dir`"):
        load_config(path)
