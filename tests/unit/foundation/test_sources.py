"""Sources and tokenizers as users name them: globs, folders of shards, .gz and .zst files,
and ids in the local Hugging Face cache (offline; the cache is built here in the layout
huggingface_hub writes), a run to completion on them; unsupported types refused at
validation (exit 2, the field and the file named)."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from foundation.config import load_config
from foundation.errors import ConfigError
from producer.readers.index import SourceIndex, sample_id
from sglang_sim.testing import SimServer
from testing.harness import started
from tests.conftest import DATASETS, QWEN, ROOT

GSM8K = DATASETS / "question_answer" / "gsm8k_test_first200.jsonl"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _records(n: int) -> list[dict]:
    return [json.loads(line) for line in GSM8K.read_text().splitlines()[:n]]


def _jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


def _hub_repo(hub: Path, kind: str, repo_id: str) -> Path:
    """An entry of huggingface_hub's cache: refs/main -> snapshots/<commit>/ (returned)."""
    folder = hub / f"{kind}s--{repo_id.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(COMMIT)
    snapshot = folder / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    return snapshot


@pytest.fixture
def hf_home(tmp_path, monkeypatch) -> Path:
    """A Hugging Face home with a model's tokenizer (Qwen2.5's files) and a dataset of two
    Parquet shards, offline."""
    home = tmp_path / "hf"
    model = _hub_repo(home / "hub", "model", "tokencap-test/qwen-tok")
    for file in QWEN.iterdir():  # tokenizer files and generation_config.json
        shutil.copy(file, model / file.name)
    data = _hub_repo(home / "hub", "dataset", "tokencap-test/gsm8k-shards") / "data"
    data.mkdir()
    rows = _records(40)
    for k in range(2):
        part = rows[k * 20:(k + 1) * 20]
        table = pa.table({key: [r[key] for r in part] for key in part[0]})
        pq.write_table(table, data / f"train-0000{k}-of-00002.parquet")
    monkeypatch.setenv("HF_HOME", str(home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return home


def test_a_run_on_a_model_and_a_dataset_named_by_their_hub_ids(tmp_path, hf_home,
                                                               redis_url) -> None:
    path = tmp_path / "run.toml"
    path.write_text(f"""
run = "hub"
output_dir = "{tmp_path / 'out'}"
tokenizer = "tokencap-test/qwen-tok"
[[category]]
name = "qa"
source = "hf://datasets/tokencap-test/gsm8k-shards"
cap_tokens = "none"
sampling = {{ max_new_tokens = 32 }}
""")
    cfg = load_config(path)
    snapshot = hf_home / "hub" / "models--tokencap-test--qwen-tok" / "snapshots" / COMMIT
    assert cfg.tokenizer == str(snapshot)
    # the model's own sampling comes from its generation_config.json in the cache
    assert cfg.category[0].sampling.temperature == 0.7
    assert [Path(p).name for p in cfg.category[0].sources] == [
        "train-00000-of-00002.parquet", "train-00001-of-00002.parquet"]
    with SimServer(time_scale=1000.0) as sim, started(cfg, redis_url, [sim.url], 3) as pipe:
        status = pipe.run()
    pipe.check_invariants(status)
    st = status["categories"]["qa"]
    assert st["state"] == "exhausted" and st["samples"] == 40


def test_gz_zst_globs_and_folders_of_shards_are_read(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TOKENCAP_SOURCE_CACHE", str(tmp_path / "cache"))
    rows = _records(12)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(_jsonl(rows[:3])))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(_jsonl(rows[3:6])))
    shards = tmp_path / "shards"
    shards.mkdir()
    (shards / "part-1.jsonl").write_bytes(_jsonl(rows[6:9]))
    (shards / "part-2.json").write_text(json.dumps(rows[9:12]))
    (shards / "README.md").write_text("not a source")  # skipped in a folder
    path = tmp_path / "run.toml"
    path.write_text(f"""
run = "files"
output_dir = "out"
tokenizer = "{QWEN}"
[[category]]
name = "c"
sources = ["*.jsonl.gz", "b.jsonl.zst", "shards"]
sampling = {{ max_new_tokens = 8 }}
""")
    cfg = load_config(path)
    index = SourceIndex.build(cfg.category[0].sources)
    assert [index.read(i) for i in range(len(index))] == rows
    # a compressed file keeps its own name in `where` and its stem in ids
    assert index.where(0) == f"{tmp_path / 'a.jsonl.gz'}:1"
    assert sample_id(index, 3) == "b:1" and sample_id(index, 6) == "part-1:1"
    # decompressed once: a second build reads the cached copy
    cached = sorted(p.name for p in (tmp_path / "cache").iterdir())
    SourceIndex.build(cfg.category[0].sources)
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == cached and len(cached) == 2


@pytest.mark.parametrize(("source", "message"), [
    ("x.txt", "$.category[0].source: unsupported file type .txt"),
    ("x.jsonl.bz2", "$.category[0].source: unsupported file type .jsonl.bz2"),
    ("nothing-*.jsonl", "$.category[0].source: no file matches"),
    ("hf://datasets/tokencap-test/absent", "dataset tokencap-test/absent is not in the local "
                                           "Hugging Face cache"),
])  # fmt: skip
def test_unsupported_or_missing_sources_are_refused_at_validation(
        tmp_path, hf_home, source: str, message: str) -> None:
    for name in ("x.txt", "x.jsonl.bz2"):
        (tmp_path / name).write_text('{"prompt": "hi"}\n')
    path = tmp_path / "run.toml"
    path.write_text(f"""
run = "bad"
output_dir = "out"
tokenizer = "{QWEN}"
[[category]]
name = "c"
source = "{source}"
sampling = {{ max_new_tokens = 8 }}
""")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert message in str(err.value) and str(path) in str(err.value)
    # the CLI: exit 2, one line, no traceback (plan reads nothing else)
    done = subprocess.run([sys.executable, "-m", "tokencap.cli", "plan", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and message in done.stderr and "Traceback" not in done.stderr


def test_a_tokenizer_id_not_in_the_cache_says_what_to_download(tmp_path, hf_home) -> None:
    path = tmp_path / "run.toml"
    path.write_text("""
run = "tok"
output_dir = "out"
tokenizer = "Qwen/Qwen2.5-7B-Instruct"
[[category]]
name = "c"
source = "x.jsonl"
sampling = { max_new_tokens = 8, temperature = 0.7 }
""")
    (tmp_path / "x.jsonl").write_text('{"prompt": "hi"}\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    text = str(err.value)
    assert "$.tokenizer: not a directory" in text
    assert "model Qwen/Qwen2.5-7B-Instruct is not in the local Hugging Face cache" in text
    assert "hf download Qwen/Qwen2.5-7B-Instruct --include '*.json'" in text
    assert "safetensors" not in text  # the tokenizer's files only, never the weights
