"""E[L | L > g] from a bucketed histogram, worked by hand."""

from __future__ import annotations

import msgspec
import pytest

from budget_service.estimator import MIN_SAMPLES, LengthModel, bucket_of
from budget_service.keys import HIST_BUCKET_TOKENS as W


def model(lengths: list[int], expected: int = 100, max_tokens: int = 4096) -> LengthModel:
    hist: dict[int, int] = {}
    for n in lengths:
        hist[bucket_of(n)] = hist.get(bucket_of(n), 0) + 1
    return LengthModel(hist, expected, max_tokens)


def test_before_enough_commits_the_configured_length_stands_in() -> None:
    m = model([1000] * (MIN_SAMPLES - 1), expected=300)
    assert m.mean() == 300
    assert m.conditional(500) == 501  # known to be past 500 tokens already


def test_conditional_mean_over_the_buckets_above_progress() -> None:
    # half the samples in bucket 0 (mid W/2), half in bucket 10 (mid 10.5 W)
    m = model([1] * 16 + [10 * W + 1] * 16)
    assert m.mean() == round((16 * 0.5 * W + 16 * 10.5 * W) / 32)
    # once a sample is past bucket 0 only the long ones remain possible
    assert m.conditional(W + 1) == round(10.5 * W)


def test_longer_than_anything_seen_and_the_cap() -> None:
    m = model([50] * 20, max_tokens=200)
    assert m.conditional(1000) == 200  # clamped to max_new_tokens
    m2 = model([50] * 20)
    assert m2.conditional(90) == 90 + W  # beyond the histogram: a little more than seen


def test_conditional_variance_over_the_buckets_above_progress() -> None:
    # two equal groups at bucket centres 0.5 W and 10.5 W: variance (5 W)^2 + W^2/12
    m = model([1] * 16 + [10 * W + 1] * 16)
    est, var = m.moments(0)
    assert est == m.mean()
    assert var == round((5 * W) ** 2 + W * W / 12)
    # past bucket 0 only one group is left: nothing but the within-bucket spread
    assert m.moments(W + 1)[1] == round(W * W / 12)


def test_prior_variance_and_the_room_left_cap_the_spread() -> None:
    m = model([], expected=300, max_tokens=4096)
    assert m.moments(0) == (300, 300 * 300)  # coefficient of variation 1 before commits
    # 4,000 of 4,096 tokens produced: what is left can vary by at most 96 tokens
    assert m.moments(4000)[1] <= 96 * 96


def test_a_beat_reserves_for_the_progress_at_the_next_beat() -> None:
    """Between beats a reservation cannot move while E[L | L > g] grows with g: a beat
    reserves for the progress the sample will have by the next beat, never less."""
    import time
    from types import SimpleNamespace

    from consumers.job import _Beat, _Heartbeat

    # half the outputs are ~100 tokens, half ~1,000: E[L | L > g] jumps once g passes 100
    model = LengthModel({6: 50, 62: 50}, 500, 2048)
    sent: list[tuple[int, int]] = []
    budget = SimpleNamespace(heartbeat=lambda cat, sid, est, lease_ms, var: sent.append(
        (est, var)))
    rc = SimpleNamespace(model=lambda cat: (model, 20.0), beat_s=5.0, ledger=budget,
                         cfg=SimpleNamespace(lease_ms=15_000))
    cat = SimpleNamespace(name="c")
    # 1 s in at 20 tok/s: 20 tokens now, 120 by the next beat (5 s later)
    _Heartbeat.send(_Beat(rc, cat, "s1", 7, time.monotonic() - 1.0))
    (est, var), = sent
    assert model.moments(20)[0] < model.moments(120)[0]
    # (any progress from 112 to 1,007 tokens gives the same moments here)
    assert (est - 7, var) == model.moments(120)


@pytest.mark.parametrize(("count", "count_rejected", "gate", "finish", "counted", "waste"), [
    ("output", True, "", "stop", 100, 0),
    ("total", True, "", "stop", 130, 0),
    ("output", True, "length", "length", 100, 100),  # a gated cut reply: counted, wasted
    ("output", False, "loop", "stop", 0, 100),  # kept out and not counted
    ("total", False, "", "length", 0, 100),  # the gate off: a cut reply is still kept out
    ("total", False, "", "stop", 130, 0)])
def test_one_rule_counts_and_wastes_a_committed_sample(count, count_rejected, gate, finish,
                                                       counted, waste) -> None:
    from budget_service.estimator import counted_tokens, waste_tokens
    from tests.helpers import make_cfg

    cfg = msgspec.structs.replace(make_cfg(), count=count, count_rejected=count_rejected)
    assert counted_tokens(cfg, 100, 30, gate, finish) == counted
    assert waste_tokens(100, gate, finish) == waste
