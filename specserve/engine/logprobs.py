"""The target's log-probabilities of committed tokens, from logits the step already computed.

Output tokens: a step's verify forward has the target's logits after every tree node; the
committed tokens (accepted path + bonus/recovered token) are scored from the rows of their
parents: root, then each accepted node. So logprobs cost no extra forward, with or without
speculation, and are the same numbers a target-only run gives (up to float rounding of
batched kernels).

Prompt tokens (`prompt_logprobs`): the prompt's forward keeps the final hidden states of its
positions; the LM head runs over them `CHUNK_ROWS` rows at a time, so a long prompt never holds
a [prompt length, vocab] logits tensor whole.

Values are raw: `log_softmax` of the target's logits, before temperature, top-k and top-p
(vLLM's default, `raw_logprobs`), so they do not depend on how the request samples.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..outputs import TokenLogprob

CHUNK_ROWS = 256  # rows of [rows, vocab] logits held at once for prompt log-probabilities


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int],
                   num_top: int | Sequence[int]) -> list[TokenLogprob]:
    """logits [k, V] (row i predicts token_ids[i]) -> k TokenLogprobs, each with `num_top`
    alternatives (one count for all rows, or one per row: a step scores every request's
    tokens in one call, with one host transfer)."""
    counts = [num_top] * len(token_ids) if isinstance(num_top, int) else list(num_top)
    logprobs = torch.log_softmax(logits.float(), dim=-1)  # [k, V]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None])[:, 0].tolist()  # [k]
    most = max(counts, default=0)
    if most:
        top = logprobs.topk(most, dim=-1)  # [k, most]
        top_ids, top_values = top.indices.tolist(), top.values.tolist()
    else:
        top_ids = top_values = [[] for _ in chosen]
    return [TokenLogprob(t, v, list(zip(i[:c], tv[:c])))
            for t, v, i, tv, c in zip(token_ids, chosen, top_ids, top_values, counts)]


def chunked_token_logprobs(hidden: torch.Tensor, token_ids: Sequence[int], num_top: int,
                           compute_logits: Callable[[torch.Tensor], torch.Tensor],
                           chunk_rows: int = CHUNK_ROWS) -> list[TokenLogprob]:
    """hidden [k, H] final hidden states (row i predicts token_ids[i]) -> k TokenLogprobs,
    the LM head applied `chunk_rows` rows at a time."""
    out: list[TokenLogprob] = []
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = hidden[start:start + chunk_rows]  # [<= chunk_rows, H]
        out += token_logprobs(compute_logits(rows), token_ids[start:start + chunk_rows],
                              num_top)
    return out
