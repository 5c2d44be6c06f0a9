"""Dataset presets (`preset = "NAME"`) read real records of their dataset (samples with
provenance: tests/fixtures/datasets/presets/PROVENANCE.md) end to end through `tokencap
preview`, from a local file or from the dataset's own files in the local Hugging Face cache;
a preset beside the fields it sets is refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from foundation.config import load_config
from foundation.errors import ConfigError
from foundation.presets import PRESETS
from tests.conftest import DATASETS, FIXTURES
from tests.unit.foundation.test_sources import _hub_repo

SAMPLES = DATASETS / "presets"
QWEN3 = FIXTURES / "tokenizers" / "qwen3"
# each preset's real samples
SAMPLED = {
    "sharegpt": ["sharegpt/speculators_sharegpt_multiturn.jsonl"],
    "ultrachat": ["ultrachat/speculators_ultrachat_messages.jsonl"],
    "hermes": ["hermes/speculators_hermes_toolcall.jsonl",
               "hermes/hermes_function_calling_v1_card_examples.json"],
    "magpie": ["magpie/magpie_repo_example_instructions.jsonl"],
}
# no real record of these datasets could be found in a public repository (PROVENANCE.md
# says where we looked); their layouts are those the dataset cards give
NO_SAMPLE = {"openthoughts", "nemotron", "opencodeinstruct"}


def records(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".json":
        return list(json.loads(text))
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def first_user_text(preset: str, record: dict) -> str:
    """The first user turn's text of a record, read by hand from its layout."""
    if preset == "magpie":
        return str(record["instruction"])
    if preset == "ultrachat":
        return next(m["content"] for m in record["messages"] if m["role"] == "user")
    return next(t["value"] for t in record["conversations"] if t["from"] == "human")


def config(tmp_path: Path, preset: str, source: Path | None = None, extra: str = "") -> Path:
    path = tmp_path / f"{preset}.toml"
    src = f'source = "{source}"\n' if source else ""
    path.write_text(f"""
run = "presets"
output_dir = "{tmp_path / 'out'}"
tokenizer = "{QWEN3}"
[[category]]
name = "{preset}"
preset = "{preset}"
{src}{extra}cap_tokens = 100000
sampling = {{ max_new_tokens = 64 }}
""")
    return path


def preview(path: Path, n: int) -> list[dict]:
    from tokencap.cli.main import main

    out = CliRunner().invoke(main, ["preview", str(path), "-n", str(n), "--json"])
    assert out.exit_code == 0, out.output
    return list(json.loads(out.stdout))


def test_every_preset_is_sampled_or_its_gap_is_named() -> None:
    assert set(PRESETS) == set(SAMPLED) | NO_SAMPLE and not set(SAMPLED) & NO_SAMPLE
    for files in SAMPLED.values():
        for name in files:
            assert name.split("/")[-1] in (SAMPLES / "PROVENANCE.md").read_text()


@pytest.mark.parametrize("preset,sample", [(p, f) for p, fs in sorted(SAMPLED.items())
                                           for f in fs])
def test_each_preset_reads_its_real_sample(tmp_path, preset, sample) -> None:
    path = SAMPLES / sample
    rows = records(path)
    shown = preview(config(tmp_path, preset, path), len(rows))
    # every record is rendered (none skipped), each prompt holding its first user turn
    assert len(shown) == len(rows) and not any(p["skipped"] for p in shown)
    by_line = {int(p["where"].rsplit(":", 1)[1]): p for p in shown}
    assert sorted(by_line) == list(range(1, len(rows) + 1)) or path.suffix == ".json"
    for p in shown:
        assert p["prompt_tokens"] > 0
    texts = "\n".join(p["text"] for p in shown)
    for row in rows:
        assert first_user_text(preset, row).strip()[:200] in texts


def test_a_preset_without_a_source_reads_the_dataset_from_the_hub_cache(
        tmp_path, monkeypatch) -> None:
    hub = tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # ultrachat_200k ships Parquet shards: the real row, written as its first shard
    rows = records(SAMPLES / SAMPLED["ultrachat"][0])
    shard = _hub_repo(hub, "dataset", PRESETS["ultrachat"].dataset) / "data"
    shard.mkdir()
    pq.write_table(pa.Table.from_pylist(rows), shard / "train_sft-00000-of-00003.parquet")
    (shard / "test_sft-00000-of-00001.parquet").write_bytes(b"not the split the preset reads")
    # hermes ships JSON lists at the repository's top
    hermes = _hub_repo(hub, "dataset", PRESETS["hermes"].dataset)
    shutil.copy(SAMPLES / SAMPLED["hermes"][1], hermes / PRESETS["hermes"].files)
    for preset, n in (("ultrachat", 1), ("hermes", 4)):
        cfg = load_config(config(tmp_path, preset))
        assert [Path(p).parent.name for p in cfg.category[0].sources] == [
            "data" if preset == "ultrachat" else hermes.name]
        shown = preview(tmp_path / f"{preset}.toml", n)
        assert len(shown) == n and all(p["prompt_tokens"] > 0 for p in shown)
    # a preset whose dataset is not in the cache says what to download (no network)
    with pytest.raises(ConfigError, match="hf download"):
        load_config(config(tmp_path, "openthoughts"))


@pytest.mark.parametrize("extra", ['format = "messages"\n', 'field_map = { prompt = "q" }\n',
                                   'role_map = { bot = "assistant" }\n'])
def test_a_preset_beside_a_field_it_sets_is_refused(tmp_path, extra) -> None:
    path = config(tmp_path, "magpie", SAMPLES / SAMPLED["magpie"][0], extra)
    field = extra.split(" ", 1)[0]
    with pytest.raises(ConfigError, match=rf"category\[0\]\.{field}: preset 'magpie' sets it"):
        load_config(path)


def test_an_unknown_preset_lists_the_presets(tmp_path) -> None:
    path = config(tmp_path, "alpaca-gpt5", SAMPLES / SAMPLED["magpie"][0])
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert "preset" in str(err.value) and all(name in str(err.value) for name in PRESETS)
