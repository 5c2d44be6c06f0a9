"""The reply gate (`foundation.gate.check`) on token ids: each reason, and the replies it
keeps."""

from __future__ import annotations

from foundation.gate import (
    LOOP_MIN_REPEATS,
    LOOP_MIN_TOKENS,
    GateReason,
    ReplyMarkers,
    check,
    loop_span,
)

THINK, UNTHINK, CALL, END, SPACE, NL = 1, 2, 3, 4, 5, 6
QWEN3 = ReplyMarkers(reasoning_start=[THINK], reasoning_end=[UNTHINK],
                     reasoning_interrupts=[[CALL]], call_starts=[[CALL]], end_ids=[END],
                     blank_ids=[SPACE, NL])
WORDS = list(range(100, 400))  # no span repeats


def test_a_healthy_reply_is_kept() -> None:
    assert check([THINK, *WORDS[:50], UNTHINK, NL, *WORDS[50:90], END], "stop", QWEN3) is None
    assert check([*WORDS[:20], END], "stop", QWEN3) is None  # no reasoning at all
    assert check([THINK, *WORDS[:5], UNTHINK, CALL, 7, 8, END], "stop", QWEN3) is None


def test_a_cut_reply_is_length() -> None:
    assert check([THINK, *WORDS[:50]], "length", QWEN3) == GateReason.LENGTH


def test_reasoning_that_never_closes() -> None:
    assert check([THINK, *WORDS[:50], END], "stop", QWEN3) == GateReason.UNCLOSED_REASONING
    # the prompt opened the block (Kimi-K2.5): the reply writes no <think> of its own
    prompt = [*WORDS[200:210], THINK, NL]
    assert check([*WORDS[:50], END], "stop", QWEN3, prompt) == GateReason.UNCLOSED_REASONING
    assert check([*WORDS[:50], UNTHINK, *WORDS[50:60], END], "stop", QWEN3, prompt) is None
    # a prompt that closed it again (DeepSeek-V3.1 after a tool result): a plain answer
    closed = [*prompt, UNTHINK]
    assert check([*WORDS[:50], END], "stop", QWEN3, closed) is None
    # a parser that takes every reply for reasoning (DeepSeek-R1's)
    forced = ReplyMarkers(**{**{f: getattr(QWEN3, f) for f in QWEN3.__struct_fields__},
                             "reasoning_forced": True})
    assert check([*WORDS[:50], END], "stop", forced) == GateReason.UNCLOSED_REASONING
    # a call begun inside the reasoning ends it (SGLang's interrupt)
    assert check([THINK, *WORDS[:5], CALL, 7, END], "stop", QWEN3) is None


def test_nothing_after_the_reasoning_is_empty() -> None:
    assert check([THINK, *WORDS[:50], UNTHINK, NL, SPACE, END], "stop", QWEN3) == GateReason.EMPTY
    assert check([END], "stop", QWEN3) == GateReason.EMPTY
    assert check([], "stop", None) == GateReason.EMPTY
    assert check([*WORDS[:3]], "stop", None) is None


def test_a_tail_repeated_is_a_loop_even_when_cut() -> None:
    phrase = WORDS[:7]
    reps = LOOP_MIN_TOKENS // len(phrase) + 1
    looping = [THINK, *WORDS[10:60], *phrase * reps]
    assert check(looping, "length", QWEN3) == GateReason.LOOP
    assert loop_span(looping)[0] == len(phrase)
    # one token over and over
    assert check([*WORDS[:10], *[42] * LOOP_MIN_TOKENS, END], "stop", QWEN3) == GateReason.LOOP


def test_repeats_too_few_or_too_short_are_not_a_loop() -> None:
    long_span = list(range(1000, 1064))  # 64 tokens: few repeats cover many tokens
    few = [*WORDS[:20], *long_span * (LOOP_MIN_REPEATS - 1)]
    assert len(long_span) * (LOOP_MIN_REPEATS - 1) >= LOOP_MIN_TOKENS
    assert check([*few, END], "stop", QWEN3) is None
    short = [*WORDS[:20], *WORDS[30:37] * LOOP_MIN_REPEATS]  # many repeats, few tokens
    assert 7 * LOOP_MIN_REPEATS < LOOP_MIN_TOKENS
    assert check([*short, END], "stop", QWEN3) is None
    # the same two at the thresholds are loops
    assert check([*few, *long_span, END], "stop", QWEN3) == GateReason.LOOP
    enough = [*WORDS[:20], *WORDS[30:37] * (LOOP_MIN_TOKENS // 7 + 1)]
    assert check([*enough, END], "stop", QWEN3) == GateReason.LOOP
