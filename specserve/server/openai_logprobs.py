"""Log-probabilities in the two shapes OpenAI clients read them.

Chat completions: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}`,
one entry per output token with the `top_logprobs` likeliest tokens at its position.
Completions (`logprobs=N`): parallel lists `tokens`, `token_logprobs`, `top_logprobs` (a dict
token -> logprob of the N likeliest tokens plus the chosen one, so up to N + 1 entries, as vLLM
does) and `text_offset` (where each token's text starts in the choice's text); with `echo` the
prompt's tokens come first and the very first one has no logprob (`null`), as in OpenAI's API.

Token strings are the tokenizer's decoding of the token alone and `bytes` their UTF-8 bytes (a
token holding part of a multi-byte character decodes to U+FFFD, as in vLLM); with vLLM's
extension `return_tokens_as_token_ids` they are spelled `token_id:ID` instead, which no two
tokens share.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..outputs import TokenLogprob


class TokenStrings:
    """Token id -> its text, decoded once per id (the same alternatives recur constantly)."""

    def __init__(self, tokenizer, as_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.as_ids = as_ids
        self.cache: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text

    def __call__(self, token_id: int) -> str:
        """How the token is spelled in logprobs."""
        return f"token_id:{token_id}" if self.as_ids else self.text(token_id)


def _entry(strings: TokenStrings, token_id: int, logprob: float) -> dict:
    text = strings(token_id)
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(strings: TokenStrings, logprobs: Sequence[TokenLogprob]) -> dict:
    """OpenAI chat `choice.logprobs` for these output tokens."""
    return {"content": [{**_entry(strings, lp.token_id, lp.logprob),
                         "top_logprobs": [_entry(strings, t, v) for t, v in lp.top]}
                        for lp in logprobs],
            "refusal": None}


class CompletionLogprobs:
    """Builds completions `choice.logprobs`, chunk by chunk, keeping `text_offset` (in the
    choice's text, counted with each token's decoded text) running."""

    def __init__(self, strings: TokenStrings) -> None:
        self.strings = strings
        self.offset = 0  # characters of token text rendered so far

    def render(self, logprobs: Sequence[TokenLogprob | None],
               token_ids: Sequence[int]) -> dict:
        """`logprobs[i]` belongs to `token_ids[i]`; None where there is none (the first prompt
        token)."""
        strings = self.strings
        tokens, values, tops, offsets = [], [], [], []
        for token_id, lp in zip(token_ids, logprobs):
            text = strings(token_id)
            tokens.append(text)
            offsets.append(self.offset)
            self.offset += len(strings.text(token_id))
            if lp is None:
                values.append(None)
                tops.append(None)
                continue
            values.append(lp.logprob)
            top = {strings(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


def merge_completion_logprobs(parts: Sequence[dict]) -> dict | None:
    """Several rendered pieces of one choice (echoed prompt, then output) as one object."""
    if not parts:
        return None
    return {key: [v for part in parts for v in part[key]]
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
