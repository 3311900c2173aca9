"""Iteration-level scheduler: which requests advance this step, and by how many tokens.

There is no prefill phase and no decode phase. Every request has tokens (prompt + output) and
`num_computed_tokens` of them already have KV; a step computes some of the difference. A new
prompt is just a large difference (split into chunks under the token budget); a decoding request
has a difference of one token, plus the draft tree nodes it may verify in the same forward. So
prompt chunks, decode tokens and tree nodes of different requests share one target forward.

Order of service: running requests first (oldest first), then waiting ones (FCFS) while the
token budget, `max_num_seqs` and free KV blocks allow. When running requests cannot get blocks,
the newest running request is preempted: its blocks are freed and it is recomputed later from
its tokens so far, so its output does not change.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from ..config import SchedulerConfig
from .block_manager import BlockManager
from .request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # committed tokens computed this step: a prompt chunk, or 1 (the root)
    num_spec_slots: int  # KV slots reserved past them for a draft tree (0: no speculation)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    num_batched_tokens: int = 0


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 spec_slots: Callable[[Request], int] | None = None,
                 track_draft_kv: bool = False) -> None:
        self.config = config
        self.blocks = block_manager
        # How many draft-tree KV slots a decoding request wants this step (chosen per step).
        self.spec_slots = spec_slots or (lambda req: 0)
        # With a draft model, a block is shared through the prefix cache only once the draft has
        # its KV too, so a prefix hit is valid for both caches.
        self.track_draft_kv = track_draft_kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Disaggregated prefill (specserve.disagg): takes over the blocks of a finished request
        # marked `kv_hold` instead of their being freed; it frees them once they are read.
        self.hold_kv: Callable[[Request], None] | None = None

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _blocks_for(self, num_positions: int) -> int:
        return -(-num_positions // self.blocks.block_size)

    # ---- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        for req in list(self.running):
            if budget <= 0:
                break
            if req.status is not RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            num_new = min(req.num_uncomputed, budget)
            spec = 0
            if req.is_decoding:
                room = self.config.max_model_len - req.num_tokens
                spec = max(0, min(self.spec_slots(req), budget - num_new, room))
            if not self._reserve(req, req.num_computed_tokens + num_new + spec, out):
                continue
            out.scheduled.append(ScheduledRequest(req, num_new, spec))
            budget -= num_new + spec

        while (self.waiting and not out.preempted and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            req = self.waiting[0]
            num_new, spec = (self._admit_with_kv(req, budget) if req.block_table
                             else (self._admit(req, budget), 0))
            if num_new == 0:
                break
            self.waiting.popleft()
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, spec))
            budget -= num_new + spec
        out.num_batched_tokens = self.config.max_num_batched_tokens - budget
        return out

    def _reserve(self, req: Request, num_positions: int, out: SchedulerOutput) -> bool:
        """Grow req's block table to cover num_positions, preempting newer requests if needed."""
        needed = self._blocks_for(num_positions) - len(req.block_table)
        while not self.blocks.can_allocate(needed):
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        if needed > 0:
            req.block_table += self.blocks.allocate(needed)
        return True

    def _admit(self, req: Request, budget: int) -> int:
        """Give a waiting request its prefix-cache hits and blocks; return tokens to compute."""
        tokens = req.all_token_ids
        bs = self.blocks.block_size
        if len(req.block_hashes) < len(tokens) // bs:
            req.block_hashes += self.blocks.full_block_hashes(
                tokens, req.block_hashes[-1] if req.block_hashes else None,
                start_block=len(req.block_hashes))
        # At least one token must be computed, to produce the logits of the next one.
        max_hit_blocks = (len(tokens) - 1) // bs
        if req.needs_prompt_logprobs:  # cached positions would have no hidden states to score
            max_hit_blocks = 0
        hits = self.blocks.lookup_prefix(req.block_hashes[:max_hit_blocks])
        num_cached = len(hits) * bs
        num_new = min(len(tokens) - num_cached, budget)
        new_blocks = self._blocks_for(num_cached + num_new) - len(hits)
        revived = sum(1 for b in hits if self.blocks.ref_counts[b] == 0)
        if not self.blocks.can_allocate(new_blocks + revived):
            return 0
        self.blocks.record_prefix_lookup(min(len(req.block_hashes), max_hit_blocks), len(hits))
        self.blocks.acquire(hits)
        req.block_table = hits + self.blocks.allocate(new_blocks)
        req.num_cached_blocks = len(hits)
        req.kv.restart(num_cached)
        if not req.num_preemptions:
            req.num_prefix_cached_tokens = num_cached
        req.status = RequestStatus.RUNNING
        return num_new

    def _admit_with_kv(self, req: Request, budget: int) -> tuple[int, int]:
        """Admit a request that arrived with its prompt's KV in its blocks (a disaggregated
        prefill): only the tokens past it are computed, and it may speculate at once.
        Returns (tokens to compute, spec slots); (0, 0) when its blocks cannot grow."""
        num_new = min(req.num_uncomputed, budget)
        spec = 0
        if req.is_decoding:
            room = self.config.max_model_len - req.num_tokens
            spec = max(0, min(self.spec_slots(req), budget - num_new, room))
        needed = self._blocks_for(req.num_computed_tokens + num_new + spec) - len(req.block_table)
        if not self.blocks.can_allocate(needed):
            return 0, 0
        if needed > 0:
            req.block_table += self.blocks.allocate(needed)
        req.status = RequestStatus.RUNNING
        return num_new, spec

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.free_blocks(req.block_table)
        req.block_table = []
        req.num_cached_blocks = 0
        req.kv.restart(0)
        req.num_preemptions += 1
        req.status = RequestStatus.WAITING
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    # ---- after the step -------------------------------------------------------------------
    def cache_full_blocks(self, req: Request) -> None:
        """Register blocks that are now full of committed tokens whose KV both caches hold."""
        computed = req.num_computed_tokens
        if self.track_draft_kv:
            computed = min(computed, req.num_draft_computed)
        full = computed // self.blocks.block_size
        if full <= req.num_cached_blocks:
            return
        tokens = req.all_token_ids
        if len(req.block_hashes) < full:
            req.block_hashes += self.blocks.full_block_hashes(
                tokens, req.block_hashes[-1] if req.block_hashes else None,
                start_block=len(req.block_hashes), end_block=full)
        for i in range(req.num_cached_blocks, full):
            self.blocks.cache_block(req.block_table[i], req.block_hashes[i])
        req.num_cached_blocks = full

    def finish(self, req: Request) -> None:
        """Remove a finished or aborted request and return its blocks to the pool."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.kv_hold and req.is_finished and self.hold_kv is not None:
            self.hold_kv(req)  # a prefill-only request: its KV waits for the decode side
        else:
            self.blocks.free_blocks(req.block_table)
        req.block_table = []
