"""`producer/shingles.py`: what text the screens compare, normalised the same way for every
copy of a prompt."""

from __future__ import annotations

import unicodedata

from producer.formats.conversation import Conversation
from producer.shingles import Shingler, prompt_text, words


def test_words_drop_case_punctuation_spacing_and_leading_numbering() -> None:
    same = ["What is 2 + 2? Explain, briefly.",
            "  what   is 2+2 ?\n\nexplain briefly",
            "1. What is 2 + 2? Explain, briefly.",
            "Q3: WHAT IS 2 + 2? EXPLAIN, BRIEFLY.",
            "- What is 2 + 2?  Explain, briefly.",
            "Ｗｈａｔ is 2 + 2? Explain, briefly."]  # NFKC: full-width letters
    assert {tuple(words(t)) for t in same} == {("what", "is", "2", "2", "explain", "briefly")}
    # NFKC line by line is the whole text's
    from producer.shingles import _nfkc
    mixed = "Ｗｈａｔ is\ne\u0301 caf\u00e9\n\u0301x ﬁne ²"
    assert _nfkc(mixed) == unicodedata.normalize("NFKC", mixed)
    assert words(mixed) == words(unicodedata.normalize("NFKC", mixed))
    # a number that begins a line inside the text stays a word
    assert words("Add\n3. apples") == ["add", "3", "apples"]


def test_ngrams_of_a_short_text_are_one_and_order_matters() -> None:
    sh = Shingler()
    assert sh.ngrams("one two three", 5).size == 1
    assert sh.ngrams("", 5).size == 0
    assert sh.ngrams("a b c d e f g", 5).size == 3
    assert sh.ngrams("a b c d e", 5).tolist() != sh.ngrams("e d c b a", 5).tolist()
    assert Shingler().ngrams("a b c d e f", 5).tolist() == sh.ngrams("A, b c d e f!", 5).tolist()


def test_prompt_text_is_the_user_turns() -> None:
    msgs = [{"role": "system", "content": "You are kind."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": [{"type": "text", "text": "More"}]}]
    assert prompt_text(msgs) == "Hi\nMore"
    conv = Conversation(msgs, None, (2, 4))
    assert prompt_text(msgs[:2], conv) == "Hi\nMore"
    assert prompt_text([1, 2, 3]) is None
