"""Incremental detokenization that never emits half a UTF-8 character.

Decoding token by token breaks multi-byte characters (a byte-level BPE may split one emoji over
several tokens) and loses inter-token spacing in some tokenizers. We decode a short window of
recent tokens twice, with and without the newest ones, and emit the difference only once it no
longer ends in U+FFFD (the replacement character a partial byte sequence decodes to).
"""

from __future__ import annotations

from collections.abc import Sequence

# Prompt tokens kept as left context so the first output token decodes with correct spacing.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: Sequence[int]) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_id: int) -> str:
        """Add one token; return the text that became final (possibly empty)."""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if full.endswith("\ufffd"):
            return ""  # a character still incomplete: wait for its remaining bytes
        if len(full) <= len(prefix):
            # Tokens that print nothing (special tokens): move past them but keep a few tokens
            # of left context, so the window stays short however many of them come.
            self.read_offset = len(self.ids)
            self.prefix_offset = max(self.prefix_offset, self.read_offset - _CONTEXT_TOKENS)
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix):]

    def flush(self) -> str:
        """The text held back for an incomplete character, at the end of the output: the bytes
        that never completed decode as U+FFFD, as a decode of the whole output shows them."""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]
