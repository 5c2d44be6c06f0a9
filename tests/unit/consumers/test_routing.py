"""`consumers/routing.py`: which engine a sample goes to (a conversation's engine, an affinity
key's, else the less loaded of two random picks; an engine down passed over and probed
back) and the adaptive gate on an engine's waiting queue, on engines' load readings scripted
as `requests` sessions."""

from __future__ import annotations

from consumers import routing
from consumers.routing import EnginePool
from tests.helpers import QueueSession, Reply


class _Draw:
    """A stand-in for the pool's random source: random() always gives `r`."""

    def __init__(self, r: float) -> None:
        self.r = r

    def random(self) -> float:
        return self.r


def test_adaptive_gate_passes_only_on_a_reading_below_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(routing, "GATE_WAIT_S", 0.001)
    monkeypatch.setattr(routing, "GATE_REFRESH_S", 0.0)  # every look is a new reading
    for loads in (False, True):
        metrics = QueueSession([2, 3, 2, 2, 0], loads)
        pool = EnginePool(["http://e"], adaptive_max_queue=2, session=metrics)
        # queue at the bound (2), above (3), at it twice more: four waits, through on the fifth
        assert pool.gate("http://e") == 4 and metrics.reads == 5
    assert EnginePool(["http://e"], session=QueueSession([50])).gate("http://e") == 0  # no gate


def test_adaptive_gate_thins_the_passes_as_the_queue_fills(monkeypatch) -> None:
    monkeypatch.setattr(routing, "GATE_WAIT_S", 0.001)
    monkeypatch.setattr(routing, "GATE_REFRESH_S", 0.0)
    # bound 4: a reading of q passes a worker whose draw r has r * 4 < 4 - q
    for queue, r, waits in (([0], 0.99, 0), ([3, 0], 0.3, 1), ([3, 3, 1], 0.3, 2),
                            ([2, 1], 0.6, 1)):
        pool = EnginePool(["http://e"], adaptive_max_queue=4, session=QueueSession(queue))
        pool._rng = _Draw(r)  # type: ignore[assignment]
        assert pool.gate("http://e") == waits, (queue, r)


def test_adaptive_gate_counts_its_own_requests_until_the_next_reading(monkeypatch) -> None:
    monkeypatch.setattr(routing, "GATE_WAIT_S", 0.001)
    monkeypatch.setattr(routing, "GATE_REFRESH_S", 3600.0)  # the first reading stays
    metrics = QueueSession([0])
    pool = EnginePool(["http://e"], adaptive_max_queue=2, session=metrics)
    pool._rng = _Draw(0.0)  # type: ignore[assignment]
    assert pool.gate("http://e") == 0  # 0 < 2
    pool.done()  # the request ended: the next one is not back from idle
    assert pool.gate("http://e") == 0 and metrics.reads == 1  # 0 + 1 < 2 on the same reading
    pool.done()
    monkeypatch.setattr(routing, "GATE_REFRESH_S", 0.0)  # 0 + 2 is the bound: a new reading
    assert pool.gate("http://e") == 0 and metrics.reads == 2


def test_a_worker_back_from_idle_reads_the_queue_afresh(monkeypatch) -> None:
    monkeypatch.setattr(routing, "GATE_WAIT_S", 0.001)
    monkeypatch.setattr(routing, "GATE_REFRESH_S", 3600.0)
    metrics = QueueSession([0, 1, 2, 3])
    pool = EnginePool(["http://e"], adaptive_max_queue=8, session=metrics)
    pool._rng = _Draw(0.0)
    pool.gate("http://e")
    pool.done()
    pool.gate("http://e")  # busy: the old reading serves
    assert metrics.reads == 1
    monkeypatch.setattr(routing, "GATE_IDLE_S", 0.0)  # now every gap counts as idle
    pool.gate("http://e")
    assert metrics.reads == 2


class _Loads:
    """A session whose /metrics says each engine runs `running[url]` requests (mutable), and
    whose /health answers `health[url]` (200 unless set)."""

    def __init__(self, running: dict[str, int]) -> None:
        self.running = running
        self.health: dict[str, int] = {}

    def get(self, url: str, timeout: object = None, headers: object = None) -> Reply:
        base = url.split("/v1/loads")[0].split("/metrics")[0].split("/health")[0]
        if "/v1/loads" in url:
            return Reply(404)
        if url.endswith("/health"):
            return Reply(self.health.get(base, 200))
        return Reply(200, f"sglang:num_running_reqs {self.running[base]}\n"
                           "sglang:num_queue_reqs 0\n")


ENGINES = [f"http://e{i}" for i in range(4)]


def test_a_turn_goes_to_the_engine_of_the_turn_before_unless_it_is_much_busier() -> None:
    loads = _Loads(dict.fromkeys(ENGINES, 10))
    pool = EnginePool(ENGINES, session=loads)
    assert all(pool.order(prefer="http://e2")[0] == "http://e2" for _ in range(20))
    loads.running["http://e2"] = 30  # well above every other: least loaded of two instead
    for e in pool.engines:
        e.load_at = -1e9  # a fresh reading
    firsts = {pool.order(prefer="http://e2")[0] for _ in range(20)}
    assert "http://e2" not in firsts
    pool.mark_down("http://e1")  # down: never first, whatever it is preferred for
    loads.running["http://e2"] = 10
    assert all(pool.order(prefer="http://e1")[0] != "http://e1" for _ in range(20))


def test_an_affinity_key_picks_one_engine_in_every_worker_and_keys_spread() -> None:
    loads = _Loads(dict.fromkeys(ENGINES, 5))
    pools = [EnginePool(ENGINES, session=loads) for _ in range(3)]  # three worker processes
    keys = [f"{k:016x}" for k in range(400)]
    chosen = {}
    for key in keys:
        picks = {p.order(affinity=key)[0] for p in pools}
        assert len(picks) == 1, key  # the same engine, with no coordination
        chosen[key] = picks.pop()
    spread = {url: sum(1 for v in chosen.values() if v == url) for url in ENGINES}
    assert min(spread.values()) > 60, spread  # 100 each expected
    # without a key nor a preference: the least loaded of two random picks
    loads.running.update({"http://e0": 0, "http://e1": 50, "http://e2": 50, "http://e3": 50})
    pool = EnginePool(ENGINES, session=loads)
    assert sum(pool.order()[0] == "http://e0" for _ in range(200)) > 60


def test_an_engine_taken_out_comes_back_only_when_its_health_check_answers(monkeypatch) -> None:
    monkeypatch.setattr(routing, "DOWN_S", 3600.0)
    loads = _Loads(dict.fromkeys(ENGINES[:2], 0))
    pool = EnginePool(ENGINES[:2], session=loads)
    e0 = pool.engines[0]
    pool.mark_down("http://e0")
    assert all(pool.order() == ["http://e1", "http://e0"] for _ in range(10))
    # Given its time out is over and its /health fails: it stays out, for DOWN_S more
    loads.health["http://e0"] = 503
    e0.down_until = 1e-9  # long past
    assert pool.order() == ["http://e1", "http://e0"] and e0.down_until > 1e-9
    # When its /health answers 200 at the next check, Then it is sent work again
    del loads.health["http://e0"]
    e0.down_until = 1e-9
    assert sorted(pool.order()) == ["http://e0", "http://e1"] and e0.down_until == 0.0
    assert any(pool.order()[0] == "http://e0" for _ in range(50))


def test_an_engine_without_load_readings_is_said_once_and_never_waited_for(
        monkeypatch, caplog) -> None:
    class _NoLoads:
        def get(self, url: str, timeout: object = None, headers: object = None) -> Reply:
            return Reply(200 if url.endswith("/health") else 404)

    monkeypatch.setattr(routing, "GATE_WAIT_S", 0.001)
    caplog.set_level("WARNING", "consumers.routing")
    pool = EnginePool(ENGINES[:2], adaptive_max_queue=1, session=_NoLoads())
    for _ in range(5):
        assert sorted(pool.order()) == ENGINES[:2]
    said = [r.getMessage() for r in caplog.records if routing.NO_LOAD_READINGS in r.getMessage()]
    assert sorted(said) == [f"engine {e}: {routing.NO_LOAD_READINGS}" for e in ENGINES[:2]]
    assert pool.gate("http://e0") == 0  # no reading to wait on
