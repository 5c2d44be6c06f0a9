"""The run config: TOML decoded by msgspec into frozen structs, validated once.

A run config names the run, where results go, the tokenizer, the budget rules and one
`[[category]]` table per prompt category. Relative paths are resolved against the config
file's folder. Every error names the file and the field (`$.category[1].cap_tokens`).

Sampling is the model's own: with `sampling_defaults = "model"` (the default) each category's
`sampling` is completed from the model's `generation_config.json` (beside the tokenizer, or
`generation_config`), the keys SGLang and vLLM take from it (`MODEL_SAMPLING_KEYS`), and the
category's own values win. The loaded config holds the effective params: they are sent on
every request, shown by preview and stored in every row. A category left without a
temperature is refused (SGLang's `/generate` would sample at 1.0, not the model's), unless
`sampling_defaults = "engine"` says to leave unset params to the engine on purpose.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import msgspec
from msgspec import Meta, Struct

from foundation import hsfile
from foundation.engine.api import auto_read_timeout
from foundation.errors import ConfigError, UnknownCategory
from foundation.gate import ReplyMarkers
from foundation.presets import PRESETS
from foundation.sources import SourceMissing, expand_source, resolve_tokenizer
from foundation.units import parse_count

DEFAULT_CAP_TOKENS = 10_000_000
# Every Redis key and RQ queue of a run starts with this (budget_service/keys.py).
DEFAULT_KEY_PREFIX = "tokencap"
# the budget service's port: `tokencap serve`, `tokencap up` and the stack's run file
DEFAULT_BUDGET_PORT = 8321
# a run's hidden-state stage is the run `<run>.hs` (`RunConfig.stage`, tokencap/extraction.py):
# status, the live page and the report find it beside the run by that name
STATES_RUN_SUFFIX = ".hs"
NAME_RE = r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$"
Name = Annotated[str, Meta(pattern=NAME_RE)]
PositiveInt = Annotated[int, Meta(ge=1)]
NonNegInt = Annotated[int, Meta(ge=0)]
PositiveFloat = Annotated[float, Meta(gt=0)]
NonNegFloat = Annotated[float, Meta(ge=0)]

# the source formats producer/formats/records.py reads, and the multi-turn policies of
# producer/formats/turns.py
FORMATS = (
    "auto",
    "messages",
    "sharegpt",
    "alpaca",
    "question_answer",
    "problem_solution",
    "instruction_response",
    "input_output",
    "prompt",
    "query",
    "text",
    "input_ids",
)
TURN_POLICIES = ("first", "last", "all")
PRESET_NAMES = tuple(PRESETS)
# `field_map` keys producer/formats/turns.py reads (one of the first two is required;
# `context`: a passage appended to the `prompt` text, as an instruction's input)
FIELD_MAP_KEYS = ("prompt", "messages", "role", "content", "system", "tools", "context")
# the roles a `role_map` may map a source role onto
MAPPED_ROLES = ("system", "developer", "user", "assistant", "tool", "function_call")
# how a generated turn is split before it enters the history (SGLang's parser names)
REASONING_PARSERS = ("auto", "none", "deepseek-r1", "deepseek-v3", "glm45", "gpt-oss", "kimi",
                     "kimi_k2", "qwen3", "qwen3-thinking")
TOOL_CALL_PARSERS = ("auto", "none", "deepseekv3", "deepseekv31", "deepseekv32", "glm", "glm45",
                     "glm47", "gpt-oss", "kimi_k2", "llama3", "qwen", "qwen25", "qwen3_coder")
# `cap_tokens = "none"`: the category takes its whole source
UNCAPPED: Final = "none"
# what SGLang (`ModelConfig.get_default_sampling_params`, --sampling-defaults model) and vLLM
# take from a model's generation_config.json as sampling defaults
MODEL_SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
GENERATION_CONFIG = "generation_config.json"
# the benchmarks shipped with tokencap that `decontaminate` names (producer/benchmarks/); any
# other entry is a file of the user's own, read as a source is
BENCHMARKS = ("mt_bench", "humaneval", "gsm8k")


class SamplingParams(Struct, frozen=True, forbid_unknown_fields=True, omit_defaults=True):
    """SGLang sampling params sent with every request. Unset fields are not sent.

    `max_new_tokens` is required: SGLang's own default is 128, which silently truncates.
    Unknown keys are refused here because SGLang answers them with an HTTP 500.
    """

    max_new_tokens: PositiveInt
    temperature: Annotated[float, Meta(ge=0)] | None = None
    top_p: Annotated[float, Meta(gt=0, le=1)] | None = None
    top_k: int | None = None
    min_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[float, Meta(gt=0, le=2)] | None = None
    min_new_tokens: NonNegInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    sampling_seed: int | None = None
    # token id (as text) -> bias added to its logit, -100..100 (SGLang and vLLM both take it)
    logit_bias: dict[str, Annotated[float, Meta(ge=-100, le=100)]] | None = None


# how a category's modes share it: by conversations drawn (`conversation`), or each mode its
# weight of the cap as its own budget (`tokens`)
SHARES = ("conversation", "tokens")


class Mode(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One decode mode of a category (`modes = [...]`): the share of its conversations drawn
    to it (`weight`, relative to the other modes'), and what it changes: chat-template kwargs
    merged over the category's (and the run's), sampling params over the category's resolved
    sampling. `foundation.modes` draws each conversation's mode and resolves what it sends."""

    name: Name
    weight: PositiveFloat
    chat_template_kwargs: dict[str, Any] = {}
    sampling: dict[str, Any] = {}


class Category(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """One prompt category with its own queue, budget and output folder."""

    name: Name
    sampling: SamplingParams
    source: str | None = None
    sources: list[str] = []
    format: Literal[FORMATS] = "auto"  # type: ignore[valid-type]
    # tokens (`10M`, `500K`, `10_000_000` too: `foundation.units.parse_count`), or "none"
    cap_tokens: NonNegInt | str | None = None
    expected_tokens: PositiveInt | None = None
    system_prompt: str | None = None
    chat_template_kwargs: dict[str, Any] = {}
    turns: Literal[TURN_POLICIES] = "first"  # type: ignore[valid-type]
    field_map: dict[str, str] = {}
    role_map: dict[str, str] = {}
    # a dataset's layout by name (foundation/presets.py): sets format, field_map, role_map,
    # and without a source reads the dataset's files from the local Hugging Face cache
    preset: Literal[PRESET_NAMES] | None = None  # type: ignore[valid-type]
    # decode modes (`Mode`): each conversation drawn to one by a seeded hash of its id
    modes: list[Mode] = []
    share: Literal[SHARES] = "conversation"  # type: ignore[valid-type]
    # set by tokencap, not by hand: a category of `share = "tokens"` runs as one budget per
    # mode, `<category>.<mode>` (`split_by_mode`): the category it was split
    # from and the one mode it feeds
    split_of: str | None = None
    only_mode: str | None = None

    @property
    def paths(self) -> list[str]:
        return ([self.source] if self.source else []) + list(self.sources)


class NearDuplicates(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[near_duplicates]`: a prompt whose text shares at least `threshold` (Jaccard) of its
    word `ngram`-grams with a prompt fed before, in any category, is refused at intake as
    `near_duplicate` (producer/near_dups.py; docs/MIX.md)."""

    enabled: bool = True
    threshold: Annotated[float, Meta(gt=0, le=1)] = 0.8
    ngram: Annotated[int, Meta(ge=1, le=32)] = 5


StatesDtype = Literal["bfloat16", "float16", "float32", "fp8_e4m3"]


class HiddenStates(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """`[hidden_states]`: the target's hidden states of every kept row, made by an
    extraction server (vLLM's `extract_hidden_states`) through the same queue, ledger and
    workers as generation (`tokencap hidden-states CONFIG`; docs/HIDDEN_STATES.md)."""

    # the extraction server(s), SGLANG_URL style; env TOKENCAP_EXTRACT_URL overrides
    engine_url: str | None = None
    # vLLM's layer ids (k: the residual stream after k layers; the last is the pre-norm
    # target state); default (2, N//2, N-3, N) from the model's config.json
    layers: list[NonNegInt] | None = None
    # the kept states' dtype: the engine's (default: the model's torch_dtype), or
    # "fp8_e4m3", speculators' FP8 layout (a scale per token: half of bf16's bytes), made by
    # tokencap's connector on the engine, else by the worker from the engine's file
    dtype: StatesDtype | None = None
    output_dir: str = "hidden_states"
    # the model's config.json (layers, hidden size, dtype, final norm); default: beside the
    # tokenizer
    model_config: str | None = None
    # bytes of states per category (or for every category: an int); none: no limit
    max_bytes: NonNegInt | dict[str, NonNegInt] | None = None
    # set by tokencap from the model's config, not by hand
    hidden_size: PositiveInt | None = None
    num_layers: PositiveInt | None = None

    def budget_for(self, category: str) -> int | None:
        return _bytes_budget(self.max_bytes, category)


def _bytes_budget(max_bytes: int | dict[str, int] | None, category: str) -> int | None:
    if isinstance(max_bytes, dict):
        return max_bytes.get(category)
    return max_bytes


class StatesSpec(Struct, frozen=True, kw_only=True):
    """`[hidden_states]` resolved (`RunConfig.states`): every value known, nothing to
    default again. Made once from a config `load_config` resolved (or a stored copy of one)."""

    engine_url: str | None
    layers: tuple[int, ...]  # vLLM's layer ids, rising; the last is the pre-norm target
    dtype: StatesDtype
    output_dir: str
    model_config: str
    max_bytes: int | dict[str, int] | None
    hidden_size: int
    num_layers: int

    def budget_for(self, category: str) -> int | None:
        """The category's byte budget (None: none)."""
        return _bytes_budget(self.max_bytes, category)

    @property
    def bytes_per_token(self) -> int:
        """What a token costs on disk: its states and its id (the header aside)."""
        return hsfile.bytes_per_token(len(self.layers), self.hidden_size, self.dtype)


class RunConfig(Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """The whole run. Units are in the field names."""

    run: Name
    output_dir: str
    tokenizer: str | None = None
    # a tokenizer folder whose tokenizer is the model's own code (Kimi's tokenization_kimi.py):
    # run it (SGLang's --trust-remote-code); off, such a folder is refused at validation
    trust_remote_code: bool = False
    # the tokenizer's vocabulary size (`len(tokenizer)`): set by the producer from the
    # tokenizer when unset; rows count the output ids at or past it (`out_of_vocab`)
    vocab_size: PositiveInt | None = None
    chat_template_kwargs: dict[str, Any] = {}
    count: Literal["output", "total"] = "output"
    # whether replies the reply gate keeps out of training (loop, length, unclosed_reasoning,
    # empty) draw on the budget; `count_truncated` is its earlier name (None: not given)
    count_rejected: bool | None = None
    count_truncated: bool | None = None
    # the reply gate (`foundation.gate`): false writes every reply as a training row
    reply_gate: bool = True
    # a regenerated turn whose tool calls depart from those the source's next results
    # answer: "stop" the conversation there (always, for a call of another function), or
    # "replay" the results to calls of the same names in order
    on_tool_divergence: Literal["stop", "replay"] = "stop"
    hard_cap: bool = False
    margin_sigmas: Annotated[float, Meta(ge=0, le=10)] = 3.0
    cap_tokens: NonNegInt | str = DEFAULT_CAP_TOKENS  # as a category's: tokens, or "none"
    seed: int = 0
    context_length: PositiveInt | None = None
    expected_tokens: PositiveInt = 512
    high_water: PositiveInt = 16
    # send a conversation's next turn to the engine that served the turn before, and prompts
    # sharing their first tokens to one engine (their prefix caches), unless it is much busier
    affinity: bool = True
    lease_s: PositiveFloat = 30.0
    heartbeat_s: PositiveFloat = 2.0
    max_attempts: PositiveInt = 4
    lock_ttl_s: PositiveFloat = 15.0
    connect_timeout_s: PositiveFloat = 3.05
    # seconds a request may take to answer; "auto": a floor plus max_new_tokens at a quarter
    # of the decode rate observed per request (`foundation.engine.api.auto_read_timeout`)
    read_timeout_s: PositiveFloat | Literal["auto"] = "auto"
    http_retries: NonNegInt = 5
    adaptive_max_queue: NonNegInt | None = None
    # results (and dead letters) of a category committed but not yet on disk at which its
    # admission pauses until the writer catches up (0: never)
    max_unwritten: NonNegInt = 512
    backoff_max_s: PositiveFloat = 30.0
    # how long the preflight keeps trying an engine that is not ready yet (refuses
    # connections, answers 429/5xx, times out) before it stops the run (exit 9); 0: one try
    preflight_wait_s: NonNegFloat = 20.0
    key_prefix: Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,32}$")] = DEFAULT_KEY_PREFIX
    # where unset sampling params come from: the model's generation_config.json ("model"), or
    # nowhere, the engine's own defaults applying ("engine", on purpose)
    sampling_defaults: Literal["model", "engine"] = "model"
    generation_config: str | None = None  # default: <tokenizer>/generation_config.json
    reasoning_parser: Literal[REASONING_PARSERS] = "auto"  # type: ignore[valid-type]
    tool_call_parser: Literal[TOOL_CALL_PARSERS] = "auto"  # type: ignore[valid-type]
    # set by the producer, not by hand: `<run>@<digest>` of the run's manifest, which every
    # row carries (`Result.made_by`); the model family's markers as ids, for the reply gate
    # the workers run (`foundation.gate`)
    made_by: str = ""
    reply_markers: ReplyMarkers | None = None
    hidden_states: HiddenStates | None = None
    # set by tokencap: "hidden_states" for the run that extracts a run's states
    # (`<run>.hs`, `tokencap/extraction.py`), whose workers extract instead of generate
    stage: Literal["generate", "hidden_states"] = "generate"
    near_duplicates: NearDuplicates = NearDuplicates()
    # benchmarks whose items no prompt may share a word `decontaminate_ngram`-gram with
    # (`contaminated`): names of BENCHMARKS, or files (resolved against the config's folder)
    decontaminate: list[str] = []
    decontaminate_ngram: Annotated[int, Meta(ge=1, le=64)] = 13
    category: list[Category] = []

    @property
    def counts_rejected(self) -> bool:
        """`count_rejected`, else its earlier name `count_truncated`, else true."""
        for value in (self.count_rejected, self.count_truncated):
            if value is not None:
                return value
        return True

    def cap_for(self, cat: Category) -> int | None:
        """The category's cap in tokens, or None when it is uncapped (``"none"``)."""
        cap = self.cap_tokens if cat.cap_tokens is None else cat.cap_tokens
        return None if cap == UNCAPPED else int(cap)

    def expected_for(self, cat: Category) -> int:
        return cat.expected_tokens or min(self.expected_tokens, cat.sampling.max_new_tokens)

    def by_name(self, name: str) -> Category:
        for cat in self.category:
            if cat.name == name:
                return cat
        budgets = [c.name for c in self.category if c.split_of == name]
        raise UnknownCategory(self.run, name, f": share = \"tokens\" runs it as one budget "
                              f"per mode, {', '.join(budgets)}" if budgets else "")

    def table_index(self, cat: Category) -> int:
        """The index of `cat`'s `[[category]]` table in the config file (the budgets of a
        `share = "tokens"` category are its one table): what `$.category[i]` names."""
        tables: list[str] = []
        for c in self.category:
            family = c.split_of or c.name
            if family not in tables:
                tables.append(family)
        return tables.index(cat.split_of or cat.name)

    @property
    def lease_ms(self) -> int:
        """`lease_s` in ms, as the ledger's scripts take a lease."""
        return int(self.lease_s * 1000)

    def states(self) -> StatesSpec:
        """The resolved `[hidden_states]` (`ConfigError` naming the section when the config
        has none: the extraction server, layers, output folder and byte budgets)."""
        hs = self.hidden_states
        if hs is None:
            raise ConfigError("$.hidden_states", "the config has no [hidden_states] section "
                              "(the extraction server, layers, output folder and byte "
                              "budgets: docs/HIDDEN_STATES.md)")
        if hs.layers is None or hs.dtype is None or hs.hidden_size is None \
                or hs.num_layers is None or hs.model_config is None:
            raise ConfigError("$.hidden_states", "not resolved: load the config with "
                              "load_config (it reads the model's config.json)")
        return StatesSpec(engine_url=hs.engine_url, layers=tuple(hs.layers), dtype=hs.dtype,
                          output_dir=hs.output_dir, model_config=hs.model_config,
                          max_bytes=hs.max_bytes, hidden_size=hs.hidden_size,
                          num_layers=hs.num_layers)

    def read_timeout(self) -> float | None:
        """The configured read timeout in seconds, or None for "auto"."""
        return None if self.read_timeout_s == "auto" else float(self.read_timeout_s)

    def job_timeout_s(self) -> int:
        """RQ job timeout: longer than the worst HTTP retry budget (reliability.md 5.4)."""
        attempts = self.http_retries + 1
        backoff = self.http_retries * self.backoff_max_s
        read = self.read_timeout()
        if read is None:  # the longest an "auto" timeout gets, at the slowest rate assumed
            read = max(auto_read_timeout(c.sampling.max_new_tokens) for c in self.category)
        return int(attempts * (self.connect_timeout_s + read) + backoff + 60)


_FIELD_RE = re.compile(r"at `(\$[^`]*)`")


def _field(msg: str) -> str:
    m = _FIELD_RE.search(msg)
    return m.group(1) if m else "$"


def _choices(field: str) -> tuple[Any, ...]:
    """The values a field whose type is a Literal allows (() for any other field), by its
    name in the config's structs."""
    import typing

    name = field.rsplit(".", 1)[-1]
    for struct in (Category, Mode, SamplingParams, RunConfig):
        hint = typing.get_type_hints(struct, include_extras=True).get(name)
        for t in (hint, *typing.get_args(hint)):  # Annotated[...], X | None
            if typing.get_origin(t) is Literal:
                return typing.get_args(t)
            for inner in typing.get_args(t):
                if typing.get_origin(inner) is Literal:
                    return typing.get_args(inner)
    return ()


_UNKNOWN_RE = re.compile(r"unknown field `([^`]*)`")


def _did_you_mean(message: str, where: str) -> str:
    """"; did you mean `cap_tokens`?" for a misspelled key (an unknown field close to one the
    table at `where` takes), else ""."""
    import difflib

    m = _UNKNOWN_RE.search(message)
    if m is None:
        return ""
    tail = re.sub(r"\[\d+\]", "", where).rsplit(".", 1)[-1]
    tables: dict[str, tuple[str, ...]] = {
        "category": Category.__struct_fields__, "sampling": SamplingParams.__struct_fields__,
        "hidden_states": HiddenStates.__struct_fields__, "modes": Mode.__struct_fields__,
        "near_duplicates": NearDuplicates.__struct_fields__}
    fields = tables.get(tail, RunConfig.__struct_fields__)
    close = difflib.get_close_matches(m.group(1), fields, n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def _cap(value: int | str | None, field: str, path: str) -> int | str | None:
    """A cap as people write it (`foundation.units.parse_count`), or "none"."""
    if value is None or isinstance(value, int):
        return value
    if value.strip().lower() == UNCAPPED:
        return UNCAPPED
    try:
        return parse_count(value)
    except ValueError as exc:
        raise ConfigError(path, f"{field}: {exc}, or \"none\" (uncapped)") from None


def load_config(path: str | Path) -> RunConfig:
    """Read, decode and validate a run config; raise ConfigError naming file and field (and,
    for a field of a few values, the values it takes)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read config: {exc.strerror or exc}") from None
    try:
        cfg = msgspec.toml.decode(raw, type=RunConfig)
    except msgspec.ValidationError as exc:
        field = _field(str(exc))
        choices = _choices(field) if "Invalid enum value" in str(exc) else ()
        allowed = f"; choose from {', '.join(map(str, choices))}" if choices else ""
        raise ConfigError(str(path), f"invalid field {field}: {exc}{allowed}"
                          f"{_did_you_mean(str(exc), field)}") from None
    except msgspec.DecodeError as exc:
        raise ConfigError(str(path), f"not valid TOML: {exc}") from None
    return _resolve(cfg, path)


def _resolve(cfg: RunConfig, path: Path) -> RunConfig:
    base = path.resolve().parent

    def rel(p: str) -> str:
        return str((base / p).resolve()) if not Path(p).is_absolute() else p

    if not cfg.category:
        raise ConfigError(str(path), "no [[category]] defined")
    if None not in (cfg.count_rejected, cfg.count_truncated) \
            and cfg.count_rejected != cfg.count_truncated:
        raise ConfigError(str(path), "$.count_truncated: the earlier name of count_rejected, "
                          "given with another value; keep count_rejected")
    seen: set[str] = set()
    cats = []
    for i, cat in enumerate(cfg.category):
        where = f"$.category[{i}]"
        if cat.name in seen:
            raise ConfigError(str(path), f"{where}.name: duplicate category {cat.name!r}")
        seen.add(cat.name)
        if cat.preset is not None:
            cat = _with_preset(cat, where, str(path))
        if not cat.paths:
            raise ConfigError(str(path), f"{where}: needs `source` or `sources`")
        paths = []
        for j, item in enumerate(cat.paths):
            field = f"{where}.source" if cat.source and j == 0 else \
                f"{where}.sources[{j - (1 if cat.source else 0)}]"
            try:
                paths += expand_source(item, base)
            except SourceMissing as exc:
                raise ConfigError(str(path), f"{field}: {exc}") from None
        if cat.field_map:
            unknown = sorted(set(cat.field_map) - set(FIELD_MAP_KEYS))
            if unknown or not {"prompt", "messages"} & set(cat.field_map):
                raise ConfigError(str(path), f"{where}.field_map: needs a 'prompt' or a "
                                  f"'messages' key, and only {', '.join(FIELD_MAP_KEYS)} "
                                  f"(got {sorted(cat.field_map)})")
        bad_roles = sorted(set(cat.role_map.values()) - set(MAPPED_ROLES))
        if bad_roles:
            raise ConfigError(str(path), f"{where}.role_map: maps onto unknown role(s) "
                              f"{bad_roles}; the roles are {', '.join(MAPPED_ROLES)}")
        if cat.turns == "all" and cat.format == "input_ids":
            raise ConfigError(str(path), f"{where}.turns: \"all\" needs a chat format, not "
                              "input_ids")
        if cat.format != "input_ids" and cfg.tokenizer is None:
            raise ConfigError(str(path), f"{where}.format: needs a top-level `tokenizer` path")
        cats.append(msgspec.structs.replace(
            cat, source=None, sources=paths,
            cap_tokens=_cap(cat.cap_tokens, f"{where}.cap_tokens", str(path))))
    tok = cfg.tokenizer
    if tok is not None:
        try:
            tok = resolve_tokenizer(tok, base)
        except SourceMissing as exc:
            raise ConfigError(str(path), f"$.tokenizer: {exc}") from None
    gen = rel(cfg.generation_config) if cfg.generation_config else None
    if gen is not None and not Path(gen).is_file():
        raise ConfigError(str(path), f"$.generation_config: no such file: {gen}")
    if gen is None and tok is not None and (Path(tok) / GENERATION_CONFIG).is_file():
        gen = str(Path(tok) / GENERATION_CONFIG)
    cats = _with_model_sampling(cfg, cats, gen, str(path))
    cats = _with_modes(cfg, cats, _cap(cfg.cap_tokens, "$.cap_tokens", str(path)), str(path))
    out = rel(cfg.output_dir)
    _a_folder(out, "$.output_dir", str(path))
    hs = cfg.hidden_states
    if hs is not None:
        hs = _hidden_states(hs, rel, tok, str(path))
        _a_folder(hs.output_dir, "$.hidden_states.output_dir", str(path))
    cap = _cap(cfg.cap_tokens, "$.cap_tokens", str(path))
    assert cap is not None
    return msgspec.structs.replace(
        cfg, cap_tokens=cap, category=cats, tokenizer=tok, output_dir=out, generation_config=gen,
        hidden_states=hs, decontaminate=_benchmarks(cfg.decontaminate, rel, str(path)),
    )


def _benchmarks(names: list[str], rel: Callable[[str], str], path: str) -> list[str]:
    """`decontaminate` resolved: each a shipped benchmark's name, or a file of the user's own
    (its absolute path); a name tokencap does not ship that is not a file is refused."""
    out: list[str] = []
    for i, name in enumerate(names):
        if name in BENCHMARKS:
            out.append(name)
            continue
        file = rel(name)
        if not Path(file).is_file():
            raise ConfigError(path, f"$.decontaminate[{i}]: {name!r} is neither a benchmark "
                              f"tokencap ships ({', '.join(BENCHMARKS)}) nor a file: no such "
                              f"file {file}")
        out.append(file)
    if len(set(out)) != len(out):
        raise ConfigError(path, "$.decontaminate: a benchmark is named twice")
    return out


def _a_folder(folder: str, field: str, path: str) -> None:
    """A folder the run writes into: refused when something else than a folder is there."""
    p = Path(folder)
    if p.exists() and not p.is_dir():
        raise ConfigError(path, f"{field}: {folder} is a file, not a folder: name a folder "
                          "(it is made when missing)")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise ConfigError(path, f"{field}: {parent} is a file, not a folder: "
                                  f"{folder} cannot be made under it")
            return


def model_shape(config_json: str) -> tuple[int, int, str | None]:
    """(layers, hidden size, dtype) of a model from its config.json (a multimodal model's
    text part: its `text_config`)."""
    doc = json.loads(Path(config_json).read_text())
    text = doc.get("text_config") if isinstance(doc.get("text_config"), dict) else doc
    layers, hidden = text.get("num_hidden_layers"), text.get("hidden_size")
    if not isinstance(layers, int) or not isinstance(hidden, int):
        raise ValueError("no num_hidden_layers / hidden_size in it")
    dtype = text.get("torch_dtype") or text.get("dtype") or doc.get("torch_dtype")
    return layers, hidden, dtype if dtype in ("bfloat16", "float16", "float32") else None


def default_layers(n: int) -> list[int]:
    """EAGLE-3's states in vLLM's ids: low, middle, high (after 2, N//2, N-3 layers) and the
    last layer's output before the final norm (N)."""
    return [2, n // 2, n - 3, n]


def _hidden_states(hs: HiddenStates, rel: Callable[[str], str], tok: str | None,
                   path: str) -> HiddenStates:
    where = "$.hidden_states"
    model_cfg = rel(hs.model_config) if hs.model_config else (
        str(Path(tok) / "config.json") if tok else None)
    if model_cfg is None or not Path(model_cfg).is_file():
        raise ConfigError(path, f"{where}.model_config: the model's config.json (its layers "
                          f"and hidden size) is needed: {model_cfg or 'no tokenizer folder'} "
                          "is not a file; name it with model_config = PATH")
    try:
        n, hidden, dtype = model_shape(model_cfg)
    except (OSError, ValueError) as exc:
        raise ConfigError(path, f"{where}.model_config: {model_cfg}: {exc}") from None
    layers = list(hs.layers) if hs.layers is not None else default_layers(n)
    if len(set(layers)) != len(layers) or sorted(layers) != layers or len(layers) < 2:
        raise ConfigError(path, f"{where}.layers: {layers}: want at least two distinct ids in "
                          "rising order (vLLM's buffer breaks on duplicates: a model needs 7 "
                          "layers or more for the default ids)")
    if layers[-1] > n:
        raise ConfigError(path, f"{where}.layers: {layers}: the model has {n} layers (ids 0 "
                          f"to {n}; {n}: the last layer before the final norm)")
    return msgspec.structs.replace(
        hs, layers=layers, dtype=hs.dtype or dtype or "bfloat16",
        output_dir=rel(hs.output_dir), model_config=model_cfg, hidden_size=hidden,
        num_layers=n)


def _with_preset(cat: Category, where: str, path: str) -> Category:
    """The category with its preset's format, field_map and role_map (none of them given
    beside it), and the dataset's files in the Hugging Face cache when no source is."""
    preset = PRESETS[str(cat.preset)]
    given = [name for name, unset in (("format", cat.format == "auto"),
                                      ("field_map", not cat.field_map),
                                      ("role_map", not cat.role_map)) if not unset]
    if given:
        raise ConfigError(path, f"{where}.{given[0]}: preset {cat.preset!r} sets it "
                          f"(format {preset.format!r}, field_map {preset.field_map or {}}); "
                          "give one or the other")
    return msgspec.structs.replace(
        cat, format=preset.format, field_map=dict(preset.field_map),
        role_map=dict(preset.role_map), source=cat.source or (None if cat.sources
                                                             else preset.source))


def model_sampling_defaults(gen_path: str) -> dict[str, Any]:
    """The sampling defaults in a generation_config.json (`MODEL_SAMPLING_KEYS` it sets)."""
    try:
        raw = msgspec.json.decode(Path(gen_path).read_bytes())
    except (OSError, msgspec.DecodeError) as exc:
        raise ConfigError(gen_path, f"cannot read the generation config: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(gen_path, "the generation config is not a JSON object")
    return {k: raw[k] for k in MODEL_SAMPLING_KEYS if raw.get(k) is not None}


def generation_eos_ids(cfg: RunConfig) -> set[int]:
    """The `eos_token_id` (one id or a list) of the model's generation_config.json."""
    ids: set[int] = set()
    if cfg.generation_config:
        try:
            eos = msgspec.json.decode(Path(cfg.generation_config).read_bytes()).get(
                "eos_token_id")
        except (OSError, msgspec.DecodeError, AttributeError):
            eos = None
        for i in eos if isinstance(eos, list) else [eos]:
            if isinstance(i, int):
                ids.add(i)
    return ids


def with_stop_ids(cfg: RunConfig, end_of_turn: set[int]) -> RunConfig:
    """`cfg` with each category's `stop_token_ids` set to the model's end-of-turn ids (its
    tokenizer's eos, its generation config's, its family's: `producer.reply_parser`), sent
    explicitly as the other sampling params are, unless the category sets its own or the
    config leaves defaults to the engine (`sampling_defaults = "engine"`)."""
    if cfg.sampling_defaults == "engine" or not end_of_turn:
        return cfg
    cats = [c if c.sampling.stop_token_ids is not None else msgspec.structs.replace(
        c, sampling=msgspec.structs.replace(c.sampling, stop_token_ids=sorted(end_of_turn)))
        for c in cfg.category]
    return msgspec.structs.replace(cfg, category=cats)


def _with_model_sampling(cfg: RunConfig, cats: list[Category], gen: str | None,
                         path: str) -> list[Category]:
    """Each category's sampling completed from the model's defaults (module docstring)."""
    if cfg.sampling_defaults == "engine":
        return cats
    defaults = model_sampling_defaults(gen) if gen else {}
    out = []
    for i, cat in enumerate(cats):
        own = msgspec.to_builtins(cat.sampling)
        merged = {**defaults, **own}
        if "temperature" not in merged:
            where = f"$.category[{i}].sampling"
            looked = gen or (f"{cfg.tokenizer}/{GENERATION_CONFIG}" if cfg.tokenizer else
                             "no tokenizer folder")
            raise ConfigError(path, f"{where}: no temperature: the category sets none and the "
                              f"model's generation config gives none ({looked}); set "
                              f"sampling.temperature, `generation_config = PATH`, or "
                              f"`sampling_defaults = \"engine\"` to leave unset params to the "
                              f"engine on purpose (SGLang's /generate then samples at "
                              f"temperature 1.0)")
        try:
            sampling = msgspec.convert(merged, SamplingParams)
        except msgspec.ValidationError as exc:
            raise ConfigError(gen or path, f"sampling defaults for {cat.name!r}: {exc}") from None
        out.append(msgspec.structs.replace(cat, sampling=sampling))
    return out


def _with_modes(cfg: RunConfig, cats: list[Category], run_cap: int | str | None,
                path: str) -> list[Category]:
    """Each category's modes checked (names unique, a mode's sampling valid over the
    category's), and a category of `share = "tokens"` split into one budget per mode
    (`split_by_mode`)."""
    out: list[Category] = []
    for i, cat in enumerate(cats):
        where = f"$.category[{i}]"
        if cat.split_of is not None or cat.only_mode is not None:
            raise ConfigError(path, f"{where}: split_of and only_mode are set by tokencap "
                              "(share = \"tokens\"), not by hand")
        if not cat.modes:
            if cat.share != "conversation":
                raise ConfigError(path, f"{where}.share: a share between modes needs `modes`")
            out.append(cat)
            continue
        names: set[str] = set()
        for j, mode in enumerate(cat.modes):
            if mode.name in names:
                raise ConfigError(path, f"{where}.modes[{j}].name: duplicate mode "
                                  f"{mode.name!r}")
            names.add(mode.name)
            try:
                msgspec.convert({**msgspec.to_builtins(cat.sampling), **mode.sampling},
                                SamplingParams)
            except msgspec.ValidationError as exc:
                raise ConfigError(path, f"{where}.modes[{j}].sampling: {exc} (merged over the "
                                  "category's sampling)") from None
        if cat.share == "conversation":
            out.append(cat)
            continue
        cap = run_cap if cat.cap_tokens is None else cat.cap_tokens
        if cap == UNCAPPED or cap is None:
            raise ConfigError(path, f"{where}.share: \"tokens\" holds each mode to its weight "
                              "of the category's cap: the category has none (cap_tokens = "
                              "\"none\")")
        out += split_by_mode(cat, int(cap))
    taken: set[str] = set()
    for cat in out:
        if cat.name in taken:
            raise ConfigError(path, f"$.category: {cat.name!r} is both a category and the "
                              f"budget of a mode of category {cat.split_of!r} (share = "
                              "\"tokens\": `<category>.<mode>`); rename one")
        taken.add(cat.name)
    return out


def mode_shares(cat: Category) -> dict[str, float]:
    """Each mode's weight as a share of the category's (1.0 in all)."""
    total = sum(m.weight for m in cat.modes)
    return {m.name: m.weight / total for m in cat.modes}


def split_by_mode(cat: Category, cap: int) -> list[Category]:
    """A `share = "tokens"` category as one category per mode, `<category>.<mode>`, capped at
    the mode's weight of `cap` (rounded to a token), each feeding only the conversations
    drawn to its mode (`Category.only_mode`), drawn as in the category (`split_of`:
    `foundation.modes.family`)."""
    return [msgspec.structs.replace(cat, name=f"{cat.name}.{mode.name}",
                                    cap_tokens=round(cap * share), split_of=cat.name,
                                    only_mode=mode.name)
            for mode, share in zip(cat.modes, mode_shares(cat).values(), strict=True)]


def config_to_json(cfg: RunConfig) -> bytes:
    return msgspec.json.encode(cfg)


def config_from_json(data: bytes) -> RunConfig:
    return msgspec.json.decode(data, type=RunConfig)
