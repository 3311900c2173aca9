"""The model runner: owns one model's KV cache and turns segments of tokens into logits.

A forward takes a flat batch built from `Segment`s, one per request: a prompt chunk, a
decode token, or a token tree (root + nodes). The runner computes slot mappings from the block
tables, stacks the per-segment masks into one `local_mask`, runs the model once and applies the
LM head only to the rows that need logits. Target and draft each have their own runner over the
same block ids.

Under tensor parallelism the model is split across ranks (`model.shard`) and rank 0's runner
drives the others: every call's flat inputs (`StepInputs`: token ids, positions, slot mapping,
block tables, query starts, context lengths, mask, logit rows) and every KV move are broadcast
as int64 tensors before rank 0 runs its own shard; each worker's runner (`tp_worker`) runs the
same forward on its shard, the row-parallel layers all-reduce, and the logits gather to rank 0.
The engine above sees one runner, whatever the world size.

Under pipeline parallelism the model is one stage (`pipeline.stage_model.StageLM`) and rank 0's
runner is the driver of stage 0: `submit` runs stage 0's layers and passes the command, its
payload and the hidden states down the stage links (`pipeline.link`); every stage's runner does
the same with what it receives, and the last stage sends the logits and requested hidden rows
back. `collect` receives them, in submission order, so several forwards may be in flight
(`pipeline.batch_queue`); `forward` is submit then collect. KV moves and LM-head calls travel
the same links, behind the forwards sent before them, so each stage applies them in order.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import IntEnum

import torch

from specserve.kernels import copy_kv_slots

from ..distributed import WHOLE_MODEL, broadcast_from_rank0, send_command
from ..pipeline.link import StageLink
from .architectures import DecoderLM, bad_feature_layers
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
    # [n, H]: for a draft that reads them, the target's hidden state before each token
    target_hidden: torch.Tensor | None = None


def kv_bytes_per_block(model: DecoderLM, block_size: int) -> int:
    """Bytes of one KV block of `model`'s cache (in its layers' dtype, as ModelRunner holds it)."""
    spec = model.spec
    attn = model.layers[0].self_attn
    per_token = 2 * spec.num_layers * attn.num_kv_heads * spec.head_dim
    return per_token * block_size * model.dtype.itemsize


class Command(IntEnum):
    """What rank 0 asks the workers to do; header field 0 of each control message."""

    INIT_CACHE = 1  # [cmd, runner id, model, num_blocks, block_size]
    # [cmd, runner id, T, B, max_blocks, logit rows, max_query_len, has_mask, hidden rows];
    # on a pipeline link the hidden states [T, H] follow the payload
    FORWARD = 2
    MOVE_KV = 3  # [cmd, runner id, number of moves]; payload: src slots, dst slots
    STOP = 4
    # [cmd, runner id, rows]; then the hidden rows [rows, H] over the model group (the stage's
    # TP group) or the pipeline link
    LOGITS = 5


# Rank 0 numbers the runners that drive workers; a worker keeps one runner per number.
_runner_ids = itertools.count()


@dataclass
class StepInputs:
    """One forward's flat inputs, built by rank 0 and broadcast to every worker."""

    token_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, rotary position of each token
    slot_mapping: torch.Tensor  # [T] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    context_lens: torch.Tensor  # [B] int32
    logit_rows: torch.Tensor  # [R] int64, flat rows whose logits are wanted
    local_mask: torch.Tensor | None  # [T, max_query_len] bool; None = causal everywhere
    max_query_len: int
    # [Hr] int64, flat rows whose final hidden states are wanted (the last stage returns them)
    hidden_rows: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))

    FIELDS = 7  # len(header())

    def header(self) -> list[int]:
        """The FORWARD header's fields after [cmd, runner id]."""
        return [len(self.token_ids), len(self.context_lens), self.block_tables.shape[1],
                len(self.logit_rows), self.max_query_len, int(self.local_mask is not None),
                len(self.hidden_rows)]

    def payload(self) -> torch.Tensor:
        """Everything but the header, as one int64 tensor (one broadcast)."""
        parts = [self.token_ids, self.positions, self.slot_mapping, self.block_tables.flatten(),
                 self.query_start_loc, self.context_lens, self.logit_rows, self.hidden_rows]
        if self.local_mask is not None:
            parts.append(self.local_mask.flatten())
        return torch.cat([p.to(torch.int64) for p in parts])

    @staticmethod
    def payload_len(header: Sequence[int]) -> int:
        T, B, max_blocks, R, max_q, has_mask, Hr = header
        return 3 * T + B * max_blocks + (B + 1) + B + R + Hr + (T * max_q if has_mask else 0)

    @classmethod
    def unpack(cls, header: Sequence[int], payload: torch.Tensor) -> StepInputs:
        T, B, max_blocks, R, max_q, has_mask, Hr = header
        sizes = [T, T, T, B * max_blocks, B + 1, B, R, Hr, T * max_q if has_mask else 0]
        ids, pos, slots, tables, qsl, ctx, rows, hidden_rows, mask = payload.split(sizes)
        return cls(ids, pos, slots, tables.view(B, max_blocks).to(torch.int32),
                   qsl.to(torch.int32), ctx.to(torch.int32), rows,
                   mask.view(T, max_q).bool() if has_mask else None, max_q, hidden_rows)


@dataclass
class PendingResult:
    """What rank 0 waits for from the last pipeline stage, in the order it was sent: tensors of
    the given [rows, width] shapes and dtypes (results[i] once done)."""

    shapes: list[tuple[int, int, torch.dtype]]
    results: list[torch.Tensor] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return len(self.results) == len(self.shapes)

    @classmethod
    def ready(cls, *results: torch.Tensor) -> PendingResult:
        """Results computed here (no pipeline)."""
        return cls([(len(r), r.shape[-1], r.dtype) for r in results], list(results))


@dataclass
class PendingForward:
    """A submitted forward: its segments, and its logits [R, logit_width] and hidden rows [Hr, H]
    once `result` is done."""

    segments: Sequence[Segment]
    result: PendingResult


class ModelRunner:
    def __init__(self, model: DecoderLM, num_blocks: int, block_size: int,
                 runner_id: int | None = None, head_rows: bool = False) -> None:
        """`runner_id`: on a worker, the number rank 0's runner of this model has. `head_rows`:
        logits come as the LM head's own rows (`DecoderLM.compute_logits`), not spread over
        the vocabulary: a draft with a reduced head picks its tokens from them."""
        self.model = model
        self.head_rows = head_rows
        ids = model.head_token_ids
        # The width of every logits row this runner returns.
        self.logit_width = len(ids) if head_rows and ids is not None else model.spec.vocab_size
        self.block_size = block_size
        self.device, self.dtype = next(model.parameters()).device, model.dtype
        attn = model.layers[0].self_attn
        # [L (this stage's), 2, num_blocks, block_size, Hkv (this rank's), D]
        self.kv_cache = torch.zeros(model.spec.num_layers, 2, num_blocks, block_size,
                                    attn.num_kv_heads, model.spec.head_dim,
                                    dtype=self.dtype, device=self.device)
        shard = model.shard
        self.stage = getattr(model, "stage", WHOLE_MODEL)
        # A pipeline stage's neighbours; None when the model is not split into stages.
        self.link = StageLink.here(self.stage) if self.stage.is_split else None
        # Rank 0 (stage 0, TP rank 0) drives the workers' runners of the same model: its
        # stage's TP ranks by control broadcast, the later stages through the links.
        driver = runner_id is None and shard.rank == 0 and self.stage.is_first
        self.drives_workers = driver and shard.is_split
        self.drives_pipeline = driver and self.link is not None
        self.runner_id = (next(_runner_ids) if self.drives_workers or self.drives_pipeline
                          else runner_id)
        # Rank 0: results still to come from the last stage, oldest first.
        self._in_flight: deque[PendingResult] = deque()
        # Layers whose outputs the hidden rows carry beside the final states (`tap_layers`).
        self.feature_layers: tuple[int, ...] = ()
        header = [Command.INIT_CACHE, self.runner_id, shard.model, num_blocks, block_size]
        if self.drives_workers:
            send_command(header)
        if self.link is not None:
            self.link.pass_on(header)

    def tap_layers(self, layers: Sequence[int]) -> None:
        """From now on the hidden rows forwards return are [rows, (1 + len(layers)) H]: the
        final states, then these layers' outputs (what a draft with `target_feature_layers`
        reads). The model must run whole here: under pipeline parallelism the layers' outputs
        would have to travel with the stages' hidden states."""
        layers = tuple(layers)
        if layers and self.link is not None:
            raise ValueError("a draft that reads several target layers needs the target on one "
                             "pipeline stage (pp=1)")
        if bad_feature_layers(layers, self.model.spec.num_layers):
            raise ValueError(f"target layers {list(layers)}: distinct, ascending, each below "
                             f"{self.model.spec.num_layers}")
        self.feature_layers = layers

    def slots(self, block_table: Sequence[int], positions: Sequence[int]) -> list[int]:
        bs = self.block_size
        return [block_table[p // bs] * bs + p % bs for p in positions]

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The LM head over final hidden states: [k, H] -> float32 [k, logit_width].

        A split model's head is vocabulary-parallel: rank 0 sends the rows to the workers, every
        rank computes its range of the vocabulary, and rank 0 gathers them. Under pipeline
        parallelism the rows travel to the last stage, and the logits come back."""
        if len(hidden) == 0:
            return torch.zeros(0, self.logit_width)
        # (rows with tapped layers' outputs beside them: the final states come first)
        hidden = hidden[:, :self.model.spec.hidden_size].to(self.dtype).contiguous()
        header = [Command.LOGITS, self.runner_id, len(hidden)]
        if self.drives_workers:
            send_command(header)
            broadcast_from_rank0(hidden, self.model.shard)
        if not self.drives_pipeline:
            return self.model.compute_logits(hidden, self.head_rows)
        self.link.pass_on(header, hidden=hidden)
        pending = self._expect([(len(hidden), self.logit_width, torch.float32)])
        self._wait(pending)
        return pending.results[0]

    def serve_logits(self, rows: int, hidden: torch.Tensor | None = None) -> None:
        """Worker: compute this rank's part of rank 0's `logits` call on the rows [rows, H]
        (received over the TP group when `hidden` is None), or pass them to the next stage."""
        if hidden is None:
            hidden = torch.empty(rows, self.model.spec.hidden_size, dtype=self.dtype,
                                 device=self.device)
            broadcast_from_rank0(hidden, self.model.shard)
        if self.link is not None and not self.stage.is_last:
            self.link.pass_on([Command.LOGITS, self.runner_id, rows], hidden=hidden)
            return
        with torch.inference_mode():
            logits = self.model.compute_logits(hidden, self.head_rows)  # [rows, width], rank 0
        if self.link is not None and logits is not None:
            self.link.return_result(logits)

    def forward(self, segments: Sequence[Segment],
                hidden_out: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Run one forward; returns per segment the float32 logits [len(logit_rows),
        logit_width].

        With `hidden_out` (a list), also appends per segment the final hidden states of its
        `hidden_rows` ([len(hidden_rows), H], or (1 + k) H wide with k `feature_layers`); the
        caller applies `logits` to them in chunks of its choosing, so no [rows, vocab] tensor of
        a whole prompt is ever needed.
        """
        return self.collect(self.submit(segments), hidden_out)

    @torch.inference_mode()
    def submit(self, segments: Sequence[Segment]) -> PendingForward:
        """Start a forward: this rank's layers run now; under pipeline parallelism the later
        stages run it while the caller goes on (`collect` waits for its results)."""
        inputs = self.prepare(segments)
        header = [Command.FORWARD, self.runner_id, *inputs.header()]
        if self.drives_workers:
            send_command(header, inputs.payload())
        hidden = self._hidden(inputs, self._target_hidden(segments))  # [T, (1 + k) H]
        if self.drives_pipeline:
            self.link.pass_on(header, inputs.payload(), hidden)
            result = self._expect([(len(inputs.logit_rows), self.logit_width, torch.float32),
                                   (len(inputs.hidden_rows), self.model.spec.hidden_size,
                                    self.dtype)])
            return PendingForward(segments, result)
        logits = self._logit_rows(hidden, inputs)
        if logits is None:  # no segment wants logits
            logits = torch.zeros(0, self.logit_width)
        return PendingForward(segments, PendingResult.ready(
            logits, hidden[inputs.hidden_rows.to(self.device)]))

    def collect(self, pending: PendingForward, hidden_out: list[torch.Tensor] | None = None
                ) -> list[torch.Tensor]:
        """A submitted forward's logits per segment (waiting for the last stage's results, and
        those of every forward submitted before it); `hidden_out` as in `forward`."""
        self._wait(pending.result)
        logits, hidden = pending.result.results
        segments = pending.segments
        if hidden_out is not None:
            hidden_out += list(hidden.split([len(s.hidden_rows) for s in segments]))
        return list(logits.split([len(s.logit_rows) for s in segments]))

    def _expect(self, shapes: list[tuple[int, int, torch.dtype]]) -> PendingResult:
        pending = PendingResult(shapes)
        self._in_flight.append(pending)
        return pending

    def _wait(self, pending: PendingResult) -> None:
        """Receive the last stage's results, in order, up to and including `pending`'s."""
        while not pending.done:
            oldest = self._in_flight.popleft()
            oldest.results = [self.link.result(rows, width, dtype, self.device)
                              for rows, width, dtype in oldest.shapes]

    def prepare(self, segments: Sequence[Segment]) -> StepInputs:
        """Flatten the segments into one batch's inputs (host tensors)."""
        ids, positions, slot_mapping, logit_rows, hidden_rows = [], [], [], [], []
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
            hidden_rows.extend(offset + r for r in seg.hidden_rows)
            query_start.append(offset + n)
            context_lens.append(seg.start)
            block_tables[b, : len(seg.block_table)] = torch.tensor(seg.block_table,
                                                                   dtype=torch.int32)
        max_q = max(len(s.token_ids) for s in segments)
        return StepInputs(
            token_ids=torch.tensor(ids, dtype=torch.int64),
            positions=torch.tensor(positions, dtype=torch.int64),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64),
            block_tables=block_tables,
            query_start_loc=torch.tensor(query_start, dtype=torch.int32),
            context_lens=torch.tensor(context_lens, dtype=torch.int32),
            logit_rows=torch.tensor(logit_rows, dtype=torch.int64),
            local_mask=self._local_mask(segments, query_start, max_q),
            max_query_len=max_q,
            hidden_rows=torch.tensor(hidden_rows, dtype=torch.int64))

    @torch.inference_mode()
    def execute(self, inputs: StepInputs, hidden_in: torch.Tensor | None = None
                ) -> torch.Tensor | None:
        """Run this rank's shard; float32 logits [R, vocab] on the (last stage's) TP rank 0,
        None elsewhere or if R=0.

        Every rank of a split model calls this with the same inputs (the collectives inside
        pair up in order). `hidden_in` [T, H]: the previous stage's output, on a later stage.
        A stage with a next one passes the forward on; the last returns its results to rank 0.
        """
        hidden = self._hidden(inputs, hidden_in=hidden_in)  # [T, H]
        if self.link is not None and not self.stage.is_last:
            self.link.pass_on([Command.FORWARD, self.runner_id, *inputs.header()],
                              inputs.payload(), hidden)
            return None
        logits = self._logit_rows(hidden, inputs)
        if self.link is not None:
            if logits is not None:
                self.link.return_result(logits)
            self.link.return_result(hidden[inputs.hidden_rows.to(self.device)])
        return logits

    def _target_hidden(self, segments: Sequence[Segment]) -> torch.Tensor | None:
        """[T, H] the segments' `target_hidden` rows stacked (a draft that reads them runs
        whole, so they never travel to workers); None when no segment has them."""
        if all(seg.target_hidden is None for seg in segments):
            return None
        if any(seg.target_hidden is None for seg in segments):
            raise ValueError("every segment of a hidden-reading draft needs target_hidden")
        return torch.cat([seg.target_hidden for seg in segments]).to(self.device)

    def _hidden(self, inputs: StepInputs, target_hidden: torch.Tensor | None = None,
                hidden_in: torch.Tensor | None = None) -> torch.Tensor:
        """The hidden states [T, H] after this rank's shard (replicated across the TP ranks):
        the final ones, or this pipeline stage's output; [T, (1 + k) H] with k `feature_layers`.
        `hidden_in` [T, H]: a later stage's input in place of the token ids."""
        dev = self.device
        mask = inputs.local_mask
        meta = AttentionMetadata(
            slot_mapping=inputs.slot_mapping.to(dev),
            block_tables=inputs.block_tables.to(dev),
            query_start_loc=inputs.query_start_loc.to(dev),
            context_lens=inputs.context_lens.to(dev),
            local_mask=mask.to(dev) if mask is not None else None,
            max_query_len=inputs.max_query_len,
        )
        first = inputs.token_ids.to(dev) if hidden_in is None else hidden_in
        return self.model(first, inputs.positions.to(dev), self.kv_cache, meta, target_hidden,
                          taps=self.feature_layers)

    def _logit_rows(self, hidden: torch.Tensor, inputs: StepInputs) -> torch.Tensor | None:
        if len(inputs.logit_rows) == 0:
            return None
        rows = hidden[inputs.logit_rows.to(self.device), :self.model.spec.hidden_size]
        return self.model.compute_logits(rows, self.head_rows)

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
        return mask

    def move_kv(self, moves: Sequence[tuple[Sequence[int], int, int]]) -> None:
        """KV compaction: each (block_table, src, dst) moves logical position src to dst."""
        moves = [m for m in moves if m[1] != m[2]]
        if not moves:
            return
        src = [self.slots(bt, [s])[0] for bt, s, _ in moves]
        dst = [self.slots(bt, [d])[0] for bt, _, d in moves]
        slots = torch.tensor(src + dst, dtype=torch.int64)
        if self.drives_workers:
            send_command([Command.MOVE_KV, self.runner_id, len(moves)], slots)
        self.copy_slots(slots)

    def copy_slots(self, slots: torch.Tensor) -> None:
        """slots [2n] int64: the n source slots, then the n destination slots (passed on to
        the next pipeline stage first: every stage moves its own layers' KV)."""
        if self.link is not None:
            self.link.pass_on([Command.MOVE_KV, self.runner_id, len(slots) // 2], slots)
        src, dst = slots.to(self.device).chunk(2)
        copy_kv_slots(self.kv_cache, src, dst)

    # ---- KV by block (disaggregated prefill: specserve.disagg) ----------------------------
    def read_blocks(self, block_ids: Sequence[int]) -> torch.Tensor:
        """A host copy of the blocks' KV, every layer: [L, 2, n, block_size, Hkv, D]."""
        self._check_whole("read")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        return self.kv_cache.index_select(2, index).cpu()

    def write_blocks(self, block_ids: Sequence[int], kv: torch.Tensor) -> None:
        """Write kv [L, 2, n, block_size, Hkv, D] (`read_blocks`' layout) into the blocks."""
        self._check_whole("write")
        L, two, _, bs, hkv, d = self.kv_cache.shape
        expected = (L, two, len(block_ids), bs, hkv, d)
        if tuple(kv.shape) != expected or kv.dtype != self.dtype:
            raise ValueError(f"KV of shape {tuple(kv.shape)} {kv.dtype} does not fit this "
                             f"cache's {len(block_ids)} blocks: {expected} {self.dtype}")
        index = torch.tensor(list(block_ids), dtype=torch.long, device=self.device)
        self.kv_cache.index_copy_(2, index, kv.to(self.device))

    def _check_whole(self, what: str) -> None:
        # A split model's other ranks hold the other heads or layers; moving them is not built.
        if self.drives_workers or self.drives_pipeline:
            raise NotImplementedError(f"cannot {what} KV blocks of a tensor- or "
                                      f"pipeline-parallel model")
