"""Simulator settings: one frozen struct, built once, passed down explicitly.

Every knob of the simulator lives in :class:`SimConfig`; the CLI, the test helpers and the
profiles all build one of these and nothing reads the environment. Durations are *simulated*
seconds: the engine divides each of them by ``time_scale`` before sleeping, so a test can run
the default profile 100x faster than real time and still read simulated-time figures from
``/_sim/stats``. The one exception is ``FaultConfig.stall_s``, which is wall-clock seconds
because it exists to trip client timeouts.

The default profile mirrors the run described in DESIGN.md: 72 requests decoding at once give
about 1,000 output tok/s (``decode_base_s + decode_per_req_s * 72 = 72 ms`` per step, one token
per request per step), a queue forms beyond that, outputs average ~500 tokens (lognormal,
sigma 0.8), context length 32,768, Qwen2.5 vocabulary and end-of-text id.
"""

from __future__ import annotations

from pathlib import Path

import msgspec

from sglang_sim.families import FAMILIES

DEFAULT_MODEL_PATH = "tokencap-sglang-sim"
DEFAULT_WEIGHT_VERSION = "default"

DEFAULT_MAX_RUNNING_REQUESTS = 72
DEFAULT_MAX_TOTAL_TOKENS = 400_000
DEFAULT_CONTEXT_LENGTH_TOKENS = 32_768
# Qwen2.5's <|im_end|> and vocabulary size (the model family of the motivating run).
DEFAULT_EOS_TOKEN_ID = 151_645
DEFAULT_VOCAB_SIZE = 151_936

# 36 ms + 0.5 ms x 72 requests = 72 ms per decode step at batch 72 -> 1,000 tok/s.
DEFAULT_DECODE_BASE_S = 0.036
DEFAULT_DECODE_PER_REQ_S = 0.0005
# 50,000 prompt tokens/s of prefill.
DEFAULT_PREFILL_S_PER_TOKEN = 2e-5
# KV room a request must leave free beyond its prompt to be admitted (capped by what it may
# still generate); stands in for SGLang's new_token_ratio reservation.
DEFAULT_ADMIT_HEADROOM_TOKENS = 512

DEFAULT_MEAN_OUTPUT_TOKENS = 500.0
DEFAULT_OUTPUT_SIGMA = 0.8

FAULT_STATUSES = frozenset({429, 500, 502, 503, 504})
FLAVORS = ("sglang", "vllm")
# vLLM reports this version; its OpenAI-compatible server returns token ids since 0.10.2
VLLM_BLOCK_TOKENS = 16  # vLLM's default KV block on a GPU: its prefix cache matches whole ones
VLLM_VERSION = "0.32.0"  # the release the vLLM flavor answers as (read against the real one)


def version(text: str) -> tuple[int, ...]:
    """A release number as a tuple, for comparisons ("0.5.15" -> (0, 5, 15))."""
    try:
        return tuple(int(p) for p in text.split(".")[:3])
    except ValueError:
        raise ValueError(f"sglang_version must look like 0.5.23, got {text!r}") from None
# SGLang: max_req_input_len = max_req_len - 5.
RESERVED_INPUT_MARGIN_TOKENS = 5


class LengthDist(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Lognormal output-length distribution: its mean (tokens) and log-space sigma."""

    mean_tokens: float
    sigma: float

    def validate(self) -> None:
        if not self.mean_tokens >= 1.0:
            raise ValueError(f"mean_tokens must be >= 1, got {self.mean_tokens}")
        if not self.sigma >= 0.0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")


class LengthProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The JSON file read by ``--length-profile``.

    Example: ``{"default": {"mean_tokens": 500, "sigma": 0.8},
    "categories": {"B1_glaive": {"mean_tokens": 300, "sigma": 0.6}}}``.
    """

    default: LengthDist
    categories: dict[str, LengthDist] = {}


REPLY_FAULTS = ("loop", "empty", "unclosed")
# the hidden-state file faults (FaultConfig fields)
HS_FAULTS = ("hs_zero_layer_rate", "hs_nan_rate", "hs_wrong_ids_rate", "hs_truncate_rate")
HS_DTYPES = ("float32", "bfloat16", "fp8_e4m3")
HS_STATES = ("full", "table")
DEFAULT_HS_LAYER_IDS = (2, 4, 5, 8)
DEFAULT_HS_HIDDEN_SIZE = 64


class FaultConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Faults the server injects into ``/generate``; see ``sglang_sim.faults``.

    ``error_rates`` maps an HTTP status (429, 500, 502, 503, 504) to the probability that a
    request gets it; ``error_burst`` maps a status to how many of the next requests get it;
    ``stall_s`` is a wall-clock delay before each reply; ``reset_rate`` the probability that the
    connection is dropped after the request was generated, with no reply; ``bad_counts_rate``
    the probability that ``completion_tokens`` disagrees with ``len(output_ids)``;
    ``poison_token_id`` makes every request whose ``input_ids`` contain it fail with HTTP 500;
    ``reply_rates`` maps a reply fault ("loop", "empty", "unclosed": `sglang_sim.text`) to
    the probability that a request's answer has it (drawn from the request's seed, so a
    prompt gets the same answer every time; a simulator with a tokenizer only).

    With ``extract_hidden_states`` (`sglang_sim.hidden`), each ``hs_*_rate`` is the
    probability that a request's hidden-state file is damaged so: one layer slot all zeros,
    one value NaN, one of its ``token_ids`` differing from the prompt, or the file cut short
    (a torn write, still answered with its path). Each is drawn on its own.
    """

    error_rates: dict[int, float] = {}
    error_burst: dict[int, int] = {}
    stall_s: float = 0.0
    reset_rate: float = 0.0
    bad_counts_rate: float = 0.0
    poison_token_id: int | None = None
    reply_rates: dict[str, float] = {}
    hs_zero_layer_rate: float = 0.0
    hs_nan_rate: float = 0.0
    hs_wrong_ids_rate: float = 0.0
    hs_truncate_rate: float = 0.0

    def validate(self) -> None:
        for status in (*self.error_rates, *self.error_burst):
            if status not in FAULT_STATUSES:
                raise ValueError(f"fault status must be one of {sorted(FAULT_STATUSES)}: {status}")
        if any(not 0.0 <= p <= 1.0 for p in self.error_rates.values()):
            raise ValueError("error_rates probabilities must be in [0, 1]")
        if sum(self.error_rates.values()) > 1.0:
            raise ValueError("error_rates probabilities must sum to at most 1")
        if any(count < 0 for count in self.error_burst.values()):
            raise ValueError("error_burst counts must be >= 0")
        if self.stall_s < 0.0:
            raise ValueError("stall_s must be >= 0")
        if set(self.reply_rates) - set(REPLY_FAULTS):
            raise ValueError(f"reply_rates keys must be among {', '.join(REPLY_FAULTS)}")
        if any(not 0.0 <= p <= 1.0 for p in self.reply_rates.values()) \
                or sum(self.reply_rates.values()) > 1.0:
            raise ValueError("reply_rates probabilities must be in [0, 1] and sum to at most 1")
        for name in ("reset_rate", "bad_counts_rate", *HS_FAULTS):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1]")


class SimConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """All simulator knobs with their defaults (the default profile)."""

    model_path: str = DEFAULT_MODEL_PATH
    weight_version: str = DEFAULT_WEIGHT_VERSION
    # Simulated seconds per wall second; every simulated duration is divided by it.
    time_scale: float = 1.0
    max_running_requests: int = DEFAULT_MAX_RUNNING_REQUESTS
    # None = unbounded waiting queue (SGLang's default); else 503 beyond it.
    max_queued_requests: int | None = None
    max_total_tokens: int = DEFAULT_MAX_TOTAL_TOKENS
    context_length: int = DEFAULT_CONTEXT_LENGTH_TOKENS
    eos_token_id: int = DEFAULT_EOS_TOKEN_ID
    vocab_size: int = DEFAULT_VOCAB_SIZE
    seed: int = 0
    decode_base_s: float = DEFAULT_DECODE_BASE_S
    decode_per_req_s: float = DEFAULT_DECODE_PER_REQ_S
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    admit_headroom_tokens: int = DEFAULT_ADMIT_HEADROOM_TOKENS
    default_length: LengthDist = LengthDist(DEFAULT_MEAN_OUTPUT_TOKENS, DEFAULT_OUTPUT_SIGMA)
    # Per-category output lengths, selected by the X-Tokencap-Category request header.
    length_profiles: dict[str, LengthDist] = {}
    faults: FaultConfig = FaultConfig()
    # A local tokenizer directory: answers are text-like (words, reasoning, tool calls in the
    # template's syntax; `sglang_sim.text`) instead of random ids. None: random ids.
    tokenizer: str | None = None
    # With a tokenizer: the model family whose grammar the answers follow (reasoning block,
    # tool calls, end of turn; SGLang's parser names, `sglang_sim.families`). None: Qwen's.
    family: str | None = None
    # The prefix cache (`sglang_sim.prefix_cache`): its capacity in tokens (0: none) and page
    # (0: the engine's own: SGLang's radix cache matches single tokens, vLLM whole blocks of
    # 16 on a GPU, 128 in its CPU build)
    prefix_cache_tokens: int = DEFAULT_MAX_TOTAL_TOKENS
    prefix_cache_page_tokens: int = 0

    def page_tokens(self) -> int:
        """The prefix cache's page: a match is a whole number of these."""
        if self.prefix_cache_page_tokens > 0:
            return self.prefix_cache_page_tokens
        return VLLM_BLOCK_TOKENS if self.flavor == "vllm" else 1
    trust_remote_code: bool = False  # the tokenizer folder's own code may run
    # Which server it plays: SGLang (its native API, of `sglang_version`: reply shapes,
    # error bodies, routes and the context rule of that release family) or vLLM (the
    # OpenAI-compatible /v1/completions with token ids, vLLM's shapes and errors).
    flavor: str = "sglang"
    sglang_version: str = "0.5.23"
    # `--api-key`: every route but /health*, /metrics (and, for vLLM, all but /v1/*) wants
    # `Authorization: Bearer <key>`; else 401 {"error": "Unauthorized"}.
    api_key: str | None = None
    # /metrics shapes: series per DP rank (the requests split across them), duplicated per
    # TP rank (--enable-metrics-for-all-schedulers), and a priority="" total beside
    # per-priority series (--enable-priority-scheduling).
    metrics_dp_ranks: int = 1
    metrics_tp_ranks: int = 1
    metrics_priority: bool = False
    # SGLang's /server_info has context_length null unless --context-length was passed.
    context_length_flag: bool = True
    # vLLM's hidden-state extraction (`sglang_sim.hidden`; the vllm flavor only): every
    # /v1/completions request writes its prompt's states at `hs_layer_ids` (vLLM's
    # eagle_aux_hidden_state_layer_ids), `hs_hidden_size` wide, in `hs_dtype`, to a
    # safetensors file under `hs_storage_path` (the connector's shared_storage_path), and
    # the reply carries "kv_transfer_params": {"hidden_states_path": ...}.
    extract_hidden_states: bool = False
    hs_layer_ids: list[int] = msgspec.field(default_factory=lambda: list(DEFAULT_HS_LAYER_IDS))
    hs_hidden_size: int = DEFAULT_HS_HIDDEN_SIZE
    hs_dtype: str = "bfloat16"
    hs_storage_path: str | None = None
    # "full": `hidden.states` of each request's ids; "table": each token's a copy of one
    # of `hidden.TABLE_SMALL` rows encoded once (a benchmark at a large model's size: the
    # engine's cost is a copy, not the simulator's sines)
    hs_states: str = "full"
    # the files say their layer ids and final-norm side (tokencap's connector), and with
    # hs_dtype "fp8_e4m3" hold speculators' FP8 layout as that connector writes it
    hs_metadata: bool = False

    def validate(self) -> None:
        """Raise ValueError when a knob is out of range."""
        if not self.time_scale > 0.0:
            raise ValueError(f"time_scale must be > 0, got {self.time_scale}")
        if self.max_running_requests < 1:
            raise ValueError("max_running_requests must be >= 1")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise ValueError("max_queued_requests must be >= 0 or None")
        if self.context_length < 2:
            raise ValueError("context_length must be >= 2")
        if self.max_total_tokens < 2:
            raise ValueError("max_total_tokens must be >= 2")
        if self.vocab_size < 2:
            raise ValueError("vocab_size must be >= 2")
        if not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError("eos_token_id must be in [0, vocab_size)")
        if min(self.decode_base_s, self.decode_per_req_s, self.prefill_s_per_token) < 0.0:
            raise ValueError("decode/prefill times must be >= 0")
        if self.decode_base_s + self.decode_per_req_s <= 0.0:
            raise ValueError("a decode step must take some time")
        if self.admit_headroom_tokens < 0:
            raise ValueError("admit_headroom_tokens must be >= 0")
        if self.family is not None and self.family not in FAMILIES:
            raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {self.family!r}")
        if self.flavor not in FLAVORS:
            raise ValueError(f"flavor must be one of {FLAVORS}, got {self.flavor!r}")
        if min(self.metrics_dp_ranks, self.metrics_tp_ranks) < 1:
            raise ValueError("metrics_dp_ranks and metrics_tp_ranks must be >= 1")
        version(self.sglang_version)
        self._validate_hidden_states()
        self.default_length.validate()
        for dist in self.length_profiles.values():
            dist.validate()
        self.faults.validate()

    def _validate_hidden_states(self) -> None:
        if not self.hs_layer_ids or any(k < 0 for k in self.hs_layer_ids):
            raise ValueError("hs_layer_ids must be a non-empty list of layer ids >= 0")
        if len(set(self.hs_layer_ids)) != len(self.hs_layer_ids):
            raise ValueError(f"hs_layer_ids must not repeat a layer: {self.hs_layer_ids}")
        if self.hs_hidden_size < 1:
            raise ValueError("hs_hidden_size must be >= 1")
        if self.hs_dtype not in HS_DTYPES:
            raise ValueError(f"hs_dtype must be one of {HS_DTYPES}, got {self.hs_dtype!r}")
        if self.hs_states not in HS_STATES:
            raise ValueError(f"hs_states must be one of {HS_STATES}, got {self.hs_states!r}")
        if not self.extract_hidden_states:
            return
        if self.flavor != "vllm":
            raise ValueError(
                "extract_hidden_states needs flavor='vllm': it plays vLLM's "
                "extract_hidden_states speculative method and ExampleHiddenStatesConnector; "
                "stock SGLang returns the last layer's states only")
        if not self.hs_storage_path:
            raise ValueError("extract_hidden_states needs hs_storage_path (the connector's "
                             "shared_storage_path)")

    @property
    def max_req_len(self) -> int:
        """Longest prompt+output a request may hold (SGLang scheduler's ``max_req_len``)."""
        return min(self.context_length - 1, self.max_total_tokens - 1)

    @property
    def max_req_input_len(self) -> int:
        """Longest prompt the scheduler accepts, as reported by ``/server_info``."""
        return max(1, self.max_req_len - RESERVED_INPUT_MARGIN_TOKENS)

    def length_for(self, category: str | None) -> LengthDist:
        """Output-length distribution for a category; the default when unknown or None."""
        if category is None:
            return self.default_length
        return self.length_profiles.get(category, self.default_length)


# A quick profile for demos and end-to-end tests: short outputs, a small batch.
TINY_PROFILE = SimConfig(
    max_running_requests=8,
    max_total_tokens=65_536,
    context_length=8_192,
    default_length=LengthDist(mean_tokens=32.0, sigma=0.5),
)

PROFILES: dict[str, SimConfig] = {"default": SimConfig(), "tiny": TINY_PROFILE}


def load_length_profile(path: str | Path) -> LengthProfile:
    """Read and validate a ``--length-profile`` JSON file."""
    profile = msgspec.json.decode(Path(path).read_bytes(), type=LengthProfile)
    profile.default.validate()
    for dist in profile.categories.values():
        dist.validate()
    return profile
