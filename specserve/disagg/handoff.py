"""The engine's side of a disaggregated prefill: what leaves a prefill engine, what enters a
decode engine, and why that continues the request exactly.

A transfer carries the state a colocated engine has after the step that computed the prompt
and sampled the first token:
- "target_kv" [L, 2, ceil(n / block_size), block_size, Hkv, D]: the target's KV of the n prompt
  positions (every layer; the last block's tail is padding);
- "draft_kv" [Ld, 2, ceil(d / block_size), ...]: the draft's KV of the first d prompt positions
  when the prefill computed it (a draft model that catches up on prompt chunks); absent for an
  EAGLE-style draft, whose KV is computed from the target's states one step later;
- "target_hidden" [n - hidden_start, H]: for an EAGLE-style draft, the target's final hidden
  states at positions hidden_start..n-1, which the draft's first catch-up on the decode side
  reads (exactly what it would read colocated);
- "generator" [k] uint8: the request's random generator after sampling the first token, so a
  seeded request samples on as it would have colocated.
The first token and the counts travel in `TransferMeta`. On import the decode engine's next
step is then the colocated engine's second step: same KV, same draft inputs, same generator.
Greedy output is equal token for token, in every speculation mode.

The prefill side (`PrefillHandoff`) takes over a finished prefill-only request's blocks through
`Scheduler.hold_kv`, keeps them until the transfer is read (or its time to live runs out) and
frees them on the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..engine.core import EngineCore
from ..engine.request import Request
from ..outputs import RequestDelta
from .protocol import TransferMeta
from .transport import KVPayload

log = logging.getLogger("specserve.disagg")


def _num_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class HeldKV:
    """A prefilled request's blocks and the small state beside them, until they are read."""

    block_ids: list[int]  # the request's whole block table (all of it is freed on release)
    meta: TransferMeta
    hidden: torch.Tensor | None  # [n - hidden_start, H]
    generator_state: torch.Tensor  # [k] uint8
    held_since: float


class PrefillHandoff:
    """The prefill engine's held transfers (a `transport.KVSource`).

    `hold` runs on the engine thread (from `Scheduler.hold_kv`); `export` and `release` run on
    the transport's threads: export only reads blocks nobody writes (they are still referenced),
    and the blocks are freed on the engine thread through `run_on_engine`.
    """

    def __init__(self, core: EngineCore,
                 run_on_engine: Callable[[Callable[[EngineCore], list]], None],
                 ttl_s: float = 60.0) -> None:
        self.core = core
        self.run_on_engine = run_on_engine
        self.ttl_s = ttl_s
        self._held: dict[str, HeldKV] = {}  # waiting for a pull
        self._sending: dict[str, HeldKV] = {}  # being read by a pull
        self._lock = threading.Lock()
        core.scheduler.hold_kv = self.hold

    # ---- engine thread --------------------------------------------------------------------
    def hold(self, req: Request) -> None:
        """Snapshot a finished prefill-only request; its blocks stay referenced."""
        core, n = self.core, len(req.prompt_token_ids)
        # Its last chunk's full blocks join the prefix cache too (a colocated request caches
        # them on its next step; this one has none), so a later prompt can share them.
        core.scheduler.cache_full_blocks(req)
        proposer = core.proposer
        hidden, hidden_start = None, n
        if proposer is not None and proposer.reads_target_hidden:
            # Position p of the draft reads the target's row of p - 1: the draft's catch-up
            # starts at its KV length d, so it reads rows d - 1 .. n - 1.
            hidden_start = max(req.num_draft_computed - 1, 0)
            hidden = proposer.target_hidden.inputs(req.request_id, hidden_start + 1, n + 1)
        meta = TransferMeta(num_prompt_tokens=n, first_token=req.output_token_ids[0],
                            block_size=core.block_manager.block_size,
                            # (without a draft the count is the target's: nothing to send)
                            num_draft_computed=(min(req.num_draft_computed, n)
                                                if proposer is not None else 0),
                            hidden_start=hidden_start)
        with self._lock:
            self._held[req.request_id] = HeldKV(list(req.block_table), meta, hidden,
                                                req.generator.get_state(), time.monotonic())
        self.expire()

    # ---- any thread -----------------------------------------------------------------------
    def held(self, request_id: str) -> HeldKV | None:
        with self._lock:
            return self._held.get(request_id)

    def export(self, request_id: str) -> KVPayload:
        with self._lock:  # claimed: expiry can no longer free the blocks under the read
            held = self._held.pop(request_id, None)
            if held is None:
                raise KeyError(request_id)
            self._sending[request_id] = held
        meta, core = held.meta, self.core
        bs = meta.block_size
        tensors = {"target_kv": core.runner.read_blocks(
            held.block_ids[:_num_blocks(meta.num_prompt_tokens, bs)])}
        if meta.num_draft_computed:
            tensors["draft_kv"] = core.proposer.runner.read_blocks(
                held.block_ids[:_num_blocks(meta.num_draft_computed, bs)])
        if held.hidden is not None:
            tensors["target_hidden"] = held.hidden
        tensors["generator"] = held.generator_state
        return KVPayload(meta, tensors)

    def release(self, request_id: str) -> None:
        with self._lock:
            held = self._held.pop(request_id, None) or self._sending.pop(request_id, None)
        if held is not None:
            self.run_on_engine(_free(held.block_ids))

    def expire(self) -> None:
        """Free transfers nobody came for (a decode server that died before reading)."""
        now = time.monotonic()
        with self._lock:
            stale = [rid for rid, h in self._held.items() if now - h.held_since > self.ttl_s]
        for rid in stale:
            log.warning("prefilled KV of %s was not read within %g s; freed", rid, self.ttl_s)
            self.release(rid)

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held) + len(self._sending)


def _free(block_ids: list[int]) -> Callable[[EngineCore], list]:
    def free(core: EngineCore) -> list:
        core.block_manager.free_blocks(block_ids)
        return []
    return free


def import_prefilled(core: EngineCore, req: Request, payload: KVPayload) -> list[RequestDelta]:
    """Engine thread: continue `req` (made by `core.make_request`, not yet added) from a
    prefill's payload. Its first token is committed and streamed now; unless that ends it, it
    waits for the scheduler with its prompt's KV in fresh blocks. When the pool has no room
    for them, it waits without them and recomputes its prompt, like a preempted request."""
    meta = payload.meta
    n, bs = meta.num_prompt_tokens, core.block_manager.block_size
    if n != len(req.prompt_token_ids) or meta.block_size != bs:
        raise ValueError(f"a transfer of {n} prompt tokens in blocks of {meta.block_size} does "
                         f"not fit a request of {len(req.prompt_token_ids)} tokens in blocks "
                         f"of {bs}")
    req.generator.set_state(payload.tensors["generator"])
    req.spec.num_target_steps = 1  # the prefill's forward, as a colocated run counts it
    now = time.monotonic()
    req.first_scheduled_time = req.first_token_time = now
    finished = req.append_token(meta.first_token)
    core.stats.num_generation_tokens += 1
    delta = RequestDelta(req.request_id, [meta.first_token], "", time=now)
    if not finished:
        _place_kv(core, req, payload)
        core.add(req)
    else:
        delta.finish_reason, delta.metrics = req.finish_reason, req.metrics()
        core.stats.num_finished += 1
    delta.text = req.take_text_delta()
    return [delta]


def _place_kv(core: EngineCore, req: Request, payload: KVPayload) -> None:
    meta, tensors = payload.meta, payload.tensors
    n, d = meta.num_prompt_tokens, meta.num_draft_computed
    blocks = core.block_manager
    needed = _num_blocks(n, blocks.block_size)
    if not blocks.can_allocate(needed):
        log.warning("no room for %s's transferred KV (%d blocks); it recomputes its prompt",
                    req.request_id, needed)
        return
    block_ids = blocks.allocate(needed)
    try:
        core.runner.write_blocks(block_ids, tensors["target_kv"])
        if d and core.proposer is not None and "draft_kv" in tensors:
            core.proposer.runner.write_blocks(block_ids[:_num_blocks(d, blocks.block_size)],
                                              tensors["draft_kv"])
        else:
            d = 0  # this engine has no draft, or the prefill sent none: it catches up here
    except Exception:
        blocks.free_blocks(block_ids)
        raise
    req.block_table = block_ids
    req.kv.restart(n)
    req.kv.draft_reached(d)
    hidden = tensors.get("target_hidden")
    if hidden is not None and core.proposer is not None and core.proposer.reads_target_hidden:
        # The prefill sent the rows as its draft reads them (fused): kept as they are.
        core.proposer.target_hidden.record(req.request_id, meta.hidden_start, hidden)
