"""producer.affinity: which prompts get a key the engines route on."""

from __future__ import annotations

from producer.affinity import AFFINITY_PREFIX_TOKENS, SharedKeys, affinity_key

N = AFFINITY_PREFIX_TOKENS


def test_a_prompt_gets_its_key_once_another_prompt_had_its_first_tokens() -> None:
    keys = SharedKeys()
    schema = list(range(1000, 1000 + N))
    first, second = [*schema, 1, 2], [*schema, 3]
    assert keys(first) == ""  # nothing shared yet: least loaded, as without affinity
    key = keys(second)
    assert key and key == affinity_key(first)  # shared now: one engine for both
    assert keys(first) == key
    assert keys([7] * N) == ""  # too short to have a key
    assert keys([9] * (N + 1)) == ""  # a new prefix


def test_prompts_that_differ_in_their_first_tokens_get_other_keys() -> None:
    a = affinity_key([1, *range(N)])
    b = affinity_key([2, *range(N)])
    assert a and b and a != b
    assert affinity_key([1, *range(N - 1)]) == ""  # exactly the prefix: nothing after it


def test_the_least_recently_seen_key_is_forgotten_past_the_bound() -> None:
    keys = SharedKeys(kept=2)
    a, b, c = ([k, *range(N)] for k in (1, 2, 3))
    for ids in (a, b):
        assert keys(ids) == ""
    assert keys(a)  # a seen again: b is now the least recently seen
    assert keys(c) == ""  # a third key: b is forgotten
    assert keys(b) == ""  # b is new again (and pushes a out)
    assert keys(c)
