"""`producer/manifest.py`: the run's manifest, written beside its rows. It holds the config's
digest, the tokenizer's files and template by sha256, and the engines (their keys left out);
its name and the rows' `made_by` are the digest of that content, so a second write of the same
content is the same file, and a change to anything that made the rows a second one."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec
import pytest

from foundation.config import RunConfig, config_to_json
from foundation.engine.info import EngineInfo
from producer.manifest import DIGEST_HEX, manifest_path, write_manifest
from producer.render import Renderer
from tests.conftest import QWEN, write_config

ENGINE = EngineInfo(url="http://:s3cret@gpu-1:30000", api="sglang", model="Qwen/Qwen2.5-7B",
                    version="0.5.23")


@pytest.fixture(scope="module")
def qwen() -> Renderer:
    return Renderer(QWEN)


def config(tmp: Path, temperature: float = 0.7) -> RunConfig:
    (tmp / "src.jsonl").write_text('{"prompt": "Say hi."}\n')
    return write_config(tmp, f"""
run = "man"
output_dir = "{tmp / 'out'}"
tokenizer = "{QWEN}"
[[category]]
name = "c"
source = "{tmp / 'src.jsonl'}"
sampling = {{ max_new_tokens = 8, temperature = {temperature} }}
""")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_the_manifest_says_what_made_the_rows_and_its_digest_names_them(
        tmp_path: Path, qwen: Renderer) -> None:
    cfg = config(tmp_path)
    made_by, path = write_manifest(cfg, qwen, [ENGINE])
    doc = json.loads(path.read_text())
    # the rows' made_by is the run and the digest of the manifest's content, its file's name
    digest = made_by.removeprefix("man@")
    assert len(digest) == DIGEST_HEX and path == tmp_path / "out" / f"manifest-{digest}.json"
    assert doc.pop("made_by") == made_by
    assert sha256(json.dumps(doc, sort_keys=True, ensure_ascii=False).encode()).startswith(
        digest)
    assert manifest_path(Path(cfg.output_dir), made_by) == path
    # what made them: the config, the tokenizer's files and template, the engines
    assert doc["config_sha256"] == sha256(config_to_json(cfg)) and doc["config"]["run"] == "man"
    assert doc["tokenizer"] == {
        "name": QWEN.name,
        "files": {p.name: sha256(p.read_bytes()) for p in QWEN.iterdir() if p.is_file()},
        "chat_template_sha256": sha256(qwen.template.encode())}
    assert doc["engines"] == [{"url": "http://gpu-1:30000", "api": "sglang",
                               "model": "Qwen/Qwen2.5-7B", "version": "0.5.23",
                               "simulated": False}]
    assert "s3cret" not in path.read_text()  # an engine's key is never written
    assert doc["tokencap_version"]


def test_a_second_write_of_the_same_content_is_the_same_manifest(tmp_path: Path,
                                                                 qwen: Renderer) -> None:
    cfg = config(tmp_path)
    made_by, path = write_manifest(cfg, qwen, [ENGINE])
    # a resume: the config as the run stored it names its manifest already
    again = msgspec.structs.replace(cfg, made_by=made_by)
    assert write_manifest(again, qwen, [ENGINE]) == (made_by, path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left


def test_anything_that_made_the_rows_changed_gives_another_manifest(tmp_path: Path,
                                                                    qwen: Renderer) -> None:
    cfg = config(tmp_path)
    first, _ = write_manifest(cfg, qwen, [ENGINE])
    newer = msgspec.structs.replace(ENGINE, version="0.5.24")
    made = {first,
            write_manifest(config(tmp_path, temperature=0.9), qwen, [ENGINE])[0],  # sampling
            write_manifest(cfg, qwen, [newer])[0],  # the engine
            write_manifest(cfg, None, [ENGINE])[0]}  # the chat template (none rendered)
    assert len(made) == 4
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        f"manifest-{m.removeprefix('man@')}.json" for m in made)


def test_a_run_without_a_tokenizer_names_none(tmp_path: Path) -> None:
    cfg = msgspec.structs.replace(config(tmp_path), tokenizer=None)
    made_by, path = write_manifest(cfg, None, [])
    doc = json.loads(path.read_text())
    assert doc["tokenizer"] is None and doc["engines"] == [] and doc["made_by"] == made_by
