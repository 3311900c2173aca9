"""Incremental detokenization: the re-decoded window stays short, text stays exact."""

from __future__ import annotations

from specserve.engine.detokenizer import IncrementalDetokenizer


class WordTokenizer:
    """Token i is the word `w{i}` with a leading space; ids >= 100 are silent special tokens."""

    def __init__(self) -> None:
        self.longest_decode = 0

    def decode(self, ids, skip_special_tokens=True) -> str:
        self.longest_decode = max(self.longest_decode, len(ids))
        return "".join(f" w{i}" for i in ids if i < 100)


def test_silent_tokens_do_not_grow_the_window():
    tok = WordTokenizer()
    detok = IncrementalDetokenizer(tok, [1, 2, 3])
    text = detok.push(4)
    for _ in range(500):
        text += detok.push(100)
    text += detok.push(5)
    assert text == " w4 w5"
    assert tok.longest_decode <= 12
