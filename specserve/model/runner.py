"""The model runner: owns one model's KV cache and turns segments of tokens into logits.

A forward takes a flat batch built from `Segment`s, one per request: a prompt chunk, a
decode token, or a token tree (root + nodes). The runner computes slot mappings from the block
tables, stacks the per-segment masks into one `local_mask`, runs the model once and applies the
LM head only to the rows that need logits. Target and draft each have their own runner over the
same block ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specserve.kernels import copy_kv_slots

from .architectures import DecoderLM
from .attention import AttentionMetadata


@dataclass
class Segment:
    """One request's new tokens in one forward.

    The tokens occupy logical KV positions `start, start + 1, ...`; every one of them sees the
    request's `start` cached positions, and each other according to `mask` (causal when None).
    Rotary positions may differ from KV positions: a tree node sits at root position + depth.
    """

    token_ids: Sequence[int]
    positions: Sequence[int]  # rotary position of each token
    start: int  # logical KV position of the first token = tokens cached before it
    block_table: Sequence[int]
    logit_rows: Sequence[int]  # local rows whose logits are wanted
    mask: torch.Tensor | None = None  # [n, n] bool, row i sees token j; None = causal
    hidden_rows: Sequence[int] = ()  # local rows whose final hidden states are wanted


def kv_bytes_per_block(model: DecoderLM, block_size: int, dtype: torch.dtype) -> int:
    spec = model.spec
    attn = model.layers[0].self_attn
    per_token = 2 * spec.num_layers * attn.num_kv_heads * spec.head_dim
    return per_token * block_size * torch.tensor([], dtype=dtype).element_size()


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int) -> None:
        self.model = model
        self.block_size = block_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        attn = model.layers[0].self_attn
        # [L, 2, num_blocks, block_size, Hkv, D]
        self.kv_cache = torch.zeros(model.spec.num_layers, 2, num_blocks, block_size,
                                    attn.num_kv_heads, model.spec.head_dim,
                                    dtype=self.dtype, device=self.device)

    def slots(self, block_table: Sequence[int], positions: Sequence[int]) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in positions]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states: [k, H] -> float32 [k, vocab]."""
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def forward(self, segments: Sequence[Segment],
                hidden_out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Run one forward; returns per segment the float32 logits [len(logit_rows), vocab].

        With `hidden_out` (a list), also appends per segment the final hidden states of its
        `hidden_rows` ([len(hidden_rows), H]); the caller applies `logits` to them in chunks of
        its choosing, so no [rows, vocab] tensor of a whole prompt is ever needed.
        """
        ids, positions, slot_mapping, logit_rows = [], [], [], []
        query_start, context_lens = [0], []
        max_blocks = max(len(s.block_table) for s in segments)
        block_tables = torch.zeros(len(segments), max_blocks, dtype=torch.int32)
        for b, seg in enumerate(segments):
            n = len(seg.token_ids)
            offset = query_start[-1]
            ids.extend(seg.token_ids)
            positions.extend(seg.positions)
            slot_mapping.extend(self.slots(seg.block_table, range(seg.start, seg.start + n)))
            logit_rows.extend(offset + r for r in seg.logit_rows)
            query_start.append(offset + n)
            context_lens.append(seg.start)
            block_tables[b, : len(seg.block_table)] = torch.tensor(seg.block_table,
                                                                   dtype=torch.int32)
        max_q = max(len(s.token_ids) for s in segments)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=self.device),
            block_tables=block_tables.to(self.device),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=self.device),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=self.device),
            local_mask=self._local_mask(segments, query_start, max_q),
            max_query_len=max_q,
        )
        hidden = self.model(torch.tensor(ids, device=self.device),
                            torch.tensor(positions, device=self.device), self.kv_cache, meta)
        rows = torch.tensor(logit_rows, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        if hidden_out is not None:
            hidden_out += [hidden[start + torch.tensor(seg.hidden_rows, dtype=torch.long,
                                                       device=self.device)]
                           if seg.hidden_rows else hidden[:0]
                           for seg, start in zip(segments, query_start)]
        return list(logits.split([len(s.logit_rows) for s in segments]))

    def _local_mask(self, segments: Sequence[Segment], query_start: list[int], max_q: int
                    ) -> torch.Tensor | None:
        """[T, max_q] bool: the per-segment masks stacked; None when every segment is causal."""
        if all(s.mask is None for s in segments):
            return None
        mask = torch.zeros(query_start[-1], max_q, dtype=torch.bool)
        for seg, start in zip(segments, query_start):
            n = len(seg.token_ids)
            block = (seg.mask if seg.mask is not None
                     else torch.ones(n, n, dtype=torch.bool).tril())
            mask[start:start + n, :n] = block
        return mask.to(self.device)

    def move_kv(self, moves: Sequence[tuple[Sequence[int], int, int]]) -> None:
        """KV compaction: each (block_table, src, dst) moves logical position src to dst."""
        moves = [m for m in moves if m[1] != m[2]]
        if not moves:
            return
        src = [self.slots(bt, [s])[0] for bt, s, _ in moves]
        dst = [self.slots(bt, [d])[0] for bt, _, d in moves]
        copy_kv_slots(self.kv_cache, torch.tensor(src, device=self.device),
                      torch.tensor(dst, device=self.device))
