"""The engine's counters and batch-size histograms, and their JSON snapshot."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Counters:
    """Cumulative since start (or the last reset); times are simulated seconds.

    ``batch_sim_s[b]`` is the simulated time spent with ``b`` requests running (0 = idle),
    prefill included; ``batch_tokens[b]`` the tokens decoded at that batch size.
    """

    submitted_total: int = 0
    finished_total: int = 0
    aborted_total: int = 0
    rejected_queue_full_total: int = 0
    retractions_total: int = 0
    generated_tokens_total: int = 0
    finished_prompt_tokens_total: int = 0
    finished_completion_tokens_total: int = 0
    decode_steps_total: int = 0
    batch_sim_s: defaultdict[int, float] = field(default_factory=lambda: defaultdict(float))
    batch_tokens: defaultdict[int, int] = field(default_factory=lambda: defaultdict(int))

    def snapshot(self, elapsed_sim_s: float) -> dict[str, Any]:
        """JSON-ready counters plus derived figures over ``elapsed_sim_s``."""
        integral = sum(b * s for b, s in self.batch_sim_s.items())
        return {
            "sim_time_s": elapsed_sim_s,
            "submitted_total": self.submitted_total,
            "finished_total": self.finished_total,
            "aborted_total": self.aborted_total,
            "rejected_queue_full_total": self.rejected_queue_full_total,
            "retractions_total": self.retractions_total,
            "generated_tokens_total": self.generated_tokens_total,
            "finished_prompt_tokens_total": self.finished_prompt_tokens_total,
            "finished_completion_tokens_total": self.finished_completion_tokens_total,
            "decode_steps_total": self.decode_steps_total,
            "busy_sim_s": sum(s for b, s in self.batch_sim_s.items() if b > 0),
            "batch_size_time_integral": integral,
            "mean_running_batch": integral / elapsed_sim_s if elapsed_sim_s > 0 else 0.0,
            "batch_size_sim_s": {str(b): s for b, s in sorted(self.batch_sim_s.items())},
            "batch_size_tokens": {str(b): n for b, n in sorted(self.batch_tokens.items())},
        }
