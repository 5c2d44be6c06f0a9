"""Each conversation's mode: a seeded hash of the run's seed, the category and its id, placed
against the cumulative weights; what a mode sends (its kwargs and sampling over the
category's)."""

from __future__ import annotations

import math

import pytest

from foundation import modes
from foundation.config import Mode
from tests.conftest import write_config

THINK_FAST = """
modes = [{ name = "think", weight = 0.7, chat_template_kwargs = { thinking = true } },
         { name = "fast", weight = 0.3, chat_template_kwargs = { thinking = false }, \
sampling = { temperature = 0.6 } }]
"""


def config(tmp_path, extra: str = THINK_FAST, seed: int = 0, top: str = ""):
    src = tmp_path / "ids.jsonl"
    src.write_text('{"input_ids": [1, 2]}\n')
    return write_config(tmp_path, f"""
run = "modes"
output_dir = "{tmp_path / 'out'}"
seed = {seed}
cap_tokens = 1000
chat_template_kwargs = {{ run_wide = 1, thinking = "run" }}
{top}
[[category]]
name = "a"
source = "{src}"
format = "input_ids"
chat_template_kwargs = {{ own = 2 }}
sampling = {{ max_new_tokens = 64, temperature = 1.0, top_p = 0.9 }}
{extra}
""")


def test_draw_is_a_function_of_seed_category_and_conversation(tmp_path) -> None:
    cfg = config(tmp_path)
    cat = cfg.by_name("a")
    ids = [f"src:{i}" for i in range(2000)]
    first = [modes.draw(cfg, cat, i) for i in ids]
    assert first == [modes.draw(cfg, cat, i) for i in ids]  # the same at every ask
    other_seed = config(tmp_path, seed=1)
    moved = sum(a != b for a, b in zip(first, [modes.draw(other_seed, other_seed.by_name("a"), i)
                                               for i in ids], strict=True))
    assert moved > 400  # another seed draws afresh (0.42 of them expected to move)


def test_draw_shares_by_weight_and_is_no_lock_step_cycle(tmp_path) -> None:
    cfg = config(tmp_path)
    cat = cfg.by_name("a")
    n = 20_000
    drawn = [modes.draw(cfg, cat, f"src:{i}") for i in range(n)]
    think = sum(1 for m in drawn if m is not None and m.name == "think")
    sigma = math.sqrt(0.7 * 0.3 / n)
    assert abs(think / n - 0.7) < 4 * sigma
    # no cycle: runs of one mode as long as independent draws give (a cycle of 7 think and
    # 3 fast would never run 10 thinks in a row, nor have runs of 2 fasts only)
    names = "".join("t" if m is not None and m.name == "think" else "f" for m in drawn)
    assert "t" * 12 in names and "fff" in names
    assert names[:10] * (n // 10) != names


def test_pick_places_a_point_against_cumulative_weights() -> None:
    ms = [Mode(name="a", weight=1.0), Mode(name="b", weight=3.0)]
    assert modes.pick(ms, 0.0).name == "a"
    assert modes.pick(ms, 0.2499).name == "a"
    assert modes.pick(ms, 0.25).name == "b"
    assert modes.pick(ms, 0.9999999).name == "b"


def test_a_mode_sends_its_kwargs_and_sampling_over_the_categorys(tmp_path) -> None:
    cfg = config(tmp_path)
    cat = cfg.by_name("a")
    think, fast = cat.modes
    assert modes.template_kwargs(cfg, cat, think) == {"run_wide": 1, "thinking": True, "own": 2}
    assert modes.template_kwargs(cfg, cat, None) == {"run_wide": 1, "thinking": "run",
                                                     "own": 2}
    assert modes.sampling(cat, think) == cat.sampling
    s = modes.sampling(cat, fast)
    assert (s.temperature, s.top_p, s.max_new_tokens) == (0.6, 0.9, 64)


def test_no_modes_no_draw(tmp_path) -> None:
    cfg = config(tmp_path, extra="")
    cat = cfg.by_name("a")
    assert modes.draw(cfg, cat, "src:1") is None
    assert modes.feeds(cfg, cat, "src:1")


def test_share_tokens_splits_the_category_into_one_budget_per_mode(tmp_path) -> None:
    cfg = config(tmp_path, extra=THINK_FAST + 'share = "tokens"\n')
    assert [c.name for c in cfg.category] == ["a.think", "a.fast"]
    think, fast = cfg.category
    assert (cfg.cap_for(think), cfg.cap_for(fast)) == (700, 300)
    assert (think.split_of, think.only_mode, fast.only_mode) == ("a", "think", "fast")
    assert modes.family(think) == "a"
    plain = config(tmp_path, extra=THINK_FAST)
    for i in range(500):  # each record is fed by exactly one budget, the one its draw names
        sid = f"src:{i}"
        drawn = modes.draw(plain, plain.by_name("a"), sid)
        assert drawn is not None
        assert modes.draw(cfg, think, sid) == drawn
        assert [c.only_mode for c in cfg.category if modes.feeds(cfg, c, sid)] == [drawn.name]


def test_by_name_names_the_modes(tmp_path) -> None:
    cat = config(tmp_path).by_name("a")
    assert modes.by_name(cat, "fast").name == "fast"
    with pytest.raises(KeyError, match="its modes: think, fast"):
        modes.by_name(cat, "slow")


def test_the_most_a_sample_may_generate_is_its_modes_largest(tmp_path) -> None:
    cfg = config(tmp_path, extra=THINK_FAST.replace("temperature = 0.6",
                                                    "temperature = 0.6, max_new_tokens = 200"))
    assert modes.most_new_tokens(cfg.by_name("a")) == 200
    assert modes.most_new_tokens(config(tmp_path).by_name("a")) == 64
