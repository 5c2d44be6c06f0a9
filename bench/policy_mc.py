"""A Monte Carlo of admission policies on the cap scenario's mix (not a bench scenario:
evidence for the default admission policy). `python -m bench.policy_mc [RUNS] [SCALE]`
(SCALE multiplies the cap scenario's caps at scale 1; default: the scenario's own).

64 slots decode one token per step each; eight categories (the cap scenario's lengths and
caps) are served round robin; a free slot takes the next category whose policy admits a
sample. Lengths are drawn from each category's truncated lognormal, and every estimate is
the true conditional law (so only the policy differs, never the model):

- stop-after-passing: admit while counted < cap; count at the end of each sample;
- reserve-mean: reserve E[L] per sample, never updated;
- conditional: reserve E[L | L > g] with g refreshed every BEAT = 147 tokens (a 30 s
  lease's 10 s heartbeat at 14.7 tok/s per request);
- +guard: also require used + sum(max_new of in-flight) < cap (`hard_cap = true`);
- +z=Z: admit only while used + reserved + est + Z * sqrt(sum Var[L_i | L_i > g_i] + Var[L])
  < cap (`margin_sigmas = Z`; the default is 3).

All but stop-after-passing also admit when nothing of the category is in flight and
used < cap (tokencap's rule). Reported: overshoot / cap per category (mean and worst over
RUNS seeds) and the share of decode steps with fewer than 90% of the slots busy (the tail
scenario's figure).
"""

from __future__ import annotations

import math
import random
import sys
from bisect import bisect_right
from statistics import mean

from bench.cap import N, cats

DRAWS = 20_000
BEAT = 147


class Law:
    """Empirical truncated lognormal: E[L | L > g] and Var[L | L > g] for integer g."""

    def __init__(self, mean_tokens: float, sigma: float, max_new: int, rng: random.Random):
        mu = math.log(mean_tokens) - sigma * sigma / 2
        xs = sorted(min(max_new, max(1, round(rng.lognormvariate(mu, sigma))))
                    for _ in range(DRAWS))
        self.xs = xs
        self.max_new = max_new
        self.s1 = [0.0] * (len(xs) + 1)
        self.s2 = [0.0] * (len(xs) + 1)
        for i in range(len(xs) - 1, -1, -1):
            self.s1[i] = self.s1[i + 1] + xs[i]
            self.s2[i] = self.s2[i + 1] + xs[i] * xs[i]
        self.mean = self.s1[0] / len(xs)
        self.var = self.s2[0] / len(xs) - self.mean ** 2

    def cond(self, g: int) -> tuple[float, float]:
        i = bisect_right(self.xs, g)
        n = len(self.xs) - i
        if n == 0:
            return float(min(self.max_new, g + 16)), 0.0
        m = self.s1[i] / n
        return m, max(0.0, self.s2[i] / n - m * m)

    def draw(self, rng: random.Random) -> int:
        return self.xs[rng.randrange(len(self.xs))]


def simulate(policy: str, beat: int, z: float, seed: int, guard: bool = False,
             scale: float | None = None) -> tuple[list[float], float]:
    mix = cats(scale)
    rng = random.Random(seed)
    laws = [Law(c.mean, c.sigma, c.max_new, random.Random(1000 + i)) for i, c in enumerate(mix)]
    k = len(mix)
    used, counted = [0] * k, [0] * k
    closed = [False] * k
    flight: list[list[list[float]]] = [[] for _ in range(k)]  # [length, g, est, var]
    turn, below, steps = 0, 0, 0
    low = math.ceil(0.9 * N)

    def admits(c: int) -> bool:
        if closed[c]:
            return False
        if policy == "stop-after-passing":
            return counted[c] < mix[c].cap
        fl = flight[c]
        if guard and used[c] + mix[c].max_new * len(fl) >= mix[c].cap:
            return False
        if not fl:
            return used[c] < mix[c].cap
        res = sum(f[2] for f in fl)
        law = laws[c]
        margin = z * math.sqrt(sum(f[3] for f in fl) + law.var) if z else 0.0
        return used[c] + res + law.mean + margin < mix[c].cap

    while True:
        running = sum(len(fl) for fl in flight)
        while running < N:
            for _ in range(k):
                c = turn % k
                turn += 1
                if admits(c):
                    law = laws[c]
                    est = law.mean if policy != "stop-after-passing" else 0.0
                    flight[c].append([law.draw(rng), 0, est, law.var])
                    running += 1
                    break
            else:
                break
        if running == 0:
            break
        # advance to the next finish or heartbeat
        step = min(min(f[0] - f[1] for fl in flight for f in fl),
                   min(beat - f[1] % beat for fl in flight for f in fl))
        step = max(1, int(step))
        steps += step
        below += step if running < low else 0
        for c, fl in enumerate(flight):
            keep = []
            for f in fl:
                f[1] += step
                if f[1] >= f[0]:
                    used[c] += int(f[0])
                    counted[c] += int(f[0])
                    if used[c] >= mix[c].cap:
                        closed[c] = True
                    continue
                if policy != "reserve-mean" and f[1] % beat == 0:
                    f[2], f[3] = laws[c].cond(int(f[1]))
                keep.append(f)
            flight[c] = keep
    over = [(used[c] - mix[c].cap) / mix[c].cap for c in range(k)]
    return over, below / steps


def main(argv: list[str]) -> int:
    runs = int(argv[0]) if argv else 10
    scale = float(argv[1]) if len(argv) > 1 else None
    policies = [("stop-after-passing", 0.0, False), ("reserve-mean", 0.0, False),
                ("conditional", 0.0, False), ("conditional+guard", 0.0, True),
                ("conditional+z=2", 2.0, False), ("conditional+z=3", 3.0, False)]
    names = [c.name for c in cats(scale)]
    print(f"caps {cats(scale)[0].cap:,}..{cats(scale)[-1].cap:,}, {runs} runs each")
    print(f"{'policy':28s} {'mean over':>9s} {'worst':>7s} {'cats>0.5%':>9s} {'<90%':>6s}  "
          + " ".join(f"{n[:8]:>8s}" for n in names))
    for name, z, guard in policies:
        beat = BEAT if name.startswith("conditional") else 10**9  # others never re-estimate
        per_cat: list[list[float]] = [[] for _ in names]
        idles = []
        for seed in range(runs):
            over, idle = simulate(name, beat, z, seed, guard, scale)
            for i, o in enumerate(over):
                per_cat[i].append(o)
            idles.append(idle)
        flat = [o for cat in per_cat for o in cat]
        bad = sum(1 for o in flat if o > 0.005) / len(flat)
        print(f"{name:28s} {100 * mean(flat):8.2f}% {100 * max(flat):6.2f}% {100 * bad:8.0f}% "
              f"{100 * mean(idles):5.1f}%  "
              + " ".join(f"{100 * mean(c):7.2f}%" for c in per_cat), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
