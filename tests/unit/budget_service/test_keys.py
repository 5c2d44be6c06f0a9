"""`budget_service/keys.py`: the key table in its docstring names every key `Keys` builds and
no other; a category's keys share one hash tag (one Redis Cluster slot); job ids are
deterministic and of the characters RQ allows; a run is found by its meta key."""

from __future__ import annotations

import re

import pytest
from redis.crc import key_slot

from budget_service import keys as keys_module
from budget_service.budget import Budget
from budget_service.keys import CategoryKeys, Keys
from tests.helpers import make_cfg

TABLE_KEY = re.compile(r"^\| `P:([^`]+)`", re.MULTILINE)
RUN_WIDE = ("meta", "producer_lock", "writer_lock", "writer_state", "engines", "series",
            "engine_info", "engine_trouble", "disk_trouble")


def test_the_table_names_every_key_and_no_other() -> None:
    named = TABLE_KEY.findall(keys_module.__doc__ or "")
    per_category = [n.removeprefix("{cat}:") for n in named if n.startswith("{cat}:")]
    assert sorted(per_category) == sorted(CategoryKeys._fields)
    k = Keys("tokencap", "r")
    run_wide = {n for n in named if not n.startswith("{cat}:")}
    assert {f"tokencap:r:{n}" for n in run_wide} == {getattr(k, p) for p in RUN_WIDE}
    assert "| `prefix:refused`" in (keys_module.__doc__ or "")
    assert k.refused == "tokencap:refused"


def test_a_category_s_keys_are_one_cluster_slot_and_no_other_category_s() -> None:
    k = Keys("tokencap", "r")
    code, math = k.cat("code"), k.cat("math")
    assert len({key_slot(key.encode()) for key in code}) == 1
    assert all("{r:code}" in key for key in code)
    assert len(set(code)) == len(CategoryKeys._fields)
    assert not set(code) & set(math)
    assert code.state == "tokencap:r:{r:code}:state"
    assert not set(code) & set(Keys("tokencap", "r2").cat("code"))


def test_a_job_id_is_the_same_for_the_same_sample_and_seq_and_rq_takes_it() -> None:
    k = Keys("tokencap", "r")
    ids = {k.job_id("code", "a", 0), k.job_id("code", "a", 1), k.job_id("code", "b", 0),
           k.job_id("math", "a", 0), Keys("tokencap", "r2").job_id("code", "a", 0)}
    assert len(ids) == 5
    assert k.job_id("code", "a", 0) == Keys("other-prefix", "r").job_id("code", "a", 0)
    for job_id in (*ids, k.job_id("code", "conv ü/x#t12", 3)):
        assert re.fullmatch(r"[A-Za-z0-9_-]+", job_id), job_id
    assert k.job_id("code", "a", 7).endswith("-7")


@pytest.mark.parametrize("run", ["t", "run-2", "a.b"])
def test_a_run_is_found_by_its_meta_key(redis, run: str) -> None:
    budget = Budget(redis, Keys("tokencap", run))
    budget.feeding.init_run(make_cfg())
    Budget(redis, Keys("elsewhere", "x")).feeding.init_run(make_cfg())
    found = [Keys.run_of_meta("tokencap", key.decode())
             for key in redis.scan_iter(match=Keys.runs_pattern("tokencap"))]
    assert found == [run]
    assert Keys("tokencap", run).queue_name("code") == f"tokencap:{run}.code"
