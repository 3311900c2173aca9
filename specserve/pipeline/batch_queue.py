"""The batch queue: up to `pp` micro-batches in flight through the pipeline stages.

With one batch at a time, a stage waits while the others work: at pp = 2 each stage is idle half
the step. Here a step launches micro-batches while fewer than `depth` (= pp) are in flight and
some running request is not in one, then lands the oldest: its logits come back, and it is
verified and committed exactly as `EngineCore.step` does. Stage 0 (rank 0) computes the next
micro-batch, and the driver verifies and drafts, while the later stages compute the earlier ones
(vLLM's batch queue; its v0 split requests between `pp` virtual engines the same way).

A request is in at most one micro-batch at a time: its next tokens depend on the verdict of the
one in flight. Each launch schedules its share of the running requests (ceil(running / depth))
among those not in flight, and may admit waiting ones; the in-flight ones are invisible to the
scheduler meanwhile, so it neither schedules nor preempts them. Each micro-batch is one target
forward, so a speculative request's whole token tree crosses the pipeline in one micro-batch.
At batch 1 there is nothing to overlap: one step crosses every stage once.

A request aborted while in flight leaves at once (its blocks too); its rows are dropped when its
micro-batch lands. Its KV writes still happen at each stage, before those of any later
micro-batch (every stage runs its commands in order), and only at positions past what it had
committed, so a request that gets the blocks next overwrites them before it reads them.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

from ..config import EngineConfig
from ..engine.core import EngineCore
from ..engine.scheduler import ScheduledRequest, SchedulerOutput
from ..model.runner import PendingForward, Segment
from ..outputs import RequestDelta
from ..speculation.modes import OFF, SpecMode
from ..speculation.proposers import Proposal
from ..speculation.tree import TokenTree


class _Laps:
    """Wall time of a micro-batch's phases: those of its launch and of its landing, not the
    time between (other micro-batches' work)."""

    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self.restart()

    def restart(self) -> None:
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self._last
        self._last = now


@dataclass
class MicroBatch:
    """One launched target forward and what its landing needs."""

    scheduled: list[ScheduledRequest]
    modes: dict[str, SpecMode]
    trees: dict[str, TokenTree]
    draft: Proposal | None
    segments: list[Segment]
    pending: PendingForward
    timer: _Laps = field(default_factory=_Laps)


class PipelinedEngine(EngineCore):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.depth = config.pp  # micro-batches in flight at most (1: one batch at a time)
        self._queue: deque[MicroBatch] = deque()
        self._busy: set[str] = set()  # ids of the requests in a micro-batch in flight
        self.max_in_flight = 0  # the most micro-batches in flight at once so far

    def step(self) -> list[RequestDelta]:
        """Launch micro-batches up to `depth` in flight, then land the oldest."""
        while len(self._queue) < self.depth and self._launch():
            pass
        if not self._queue:
            return []
        return self._land(self._queue.popleft())

    def fail_all(self, message: str) -> list[RequestDelta]:
        # After a failed step the micro-batches in flight will not land.
        self._queue.clear()
        self._busy.clear()
        return super().fail_all(message)

    # ---- launch ---------------------------------------------------------------------------
    def _launch(self) -> bool:
        """Schedule, draft and submit one micro-batch; False when nothing could be scheduled."""
        timer = _Laps()
        out = self._schedule_share()
        timer.lap("schedule")
        for req in out.preempted:  # recomputed from the start: its target states come again
            self._forget_target_hidden(req)
        if not out.scheduled:
            self.stats.schedule_time_s += timer.laps["schedule"]
            return False
        modes = self._start_step(out.scheduled)
        trees, draft = self._propose(out.scheduled, modes)
        timer.lap("draft")
        segments = [self._target_segment(item, trees.get(item.request.request_id))
                    for item in out.scheduled]
        pending = self.runner.submit(segments)
        timer.lap("target_forward")  # stage 0's layers; the wait for the rest is added on landing
        self._queue.append(MicroBatch(out.scheduled, modes, trees, draft, segments, pending,
                                      timer))
        self._busy.update(item.request.request_id for item in out.scheduled)
        self.max_in_flight = max(self.max_in_flight, len(self._queue))
        return True

    def _schedule_share(self) -> SchedulerOutput:
        """The scheduler's output over this launch's share of the running requests not in
        flight (the others are hidden from it meanwhile, in flight or left for the next
        launch), plus any waiting requests it admits."""
        sched = self.scheduler
        everyone, config = sched.running, sched.config
        free = [r for r in everyone if r.request_id not in self._busy]
        visible = free[:max(1, -(-len(everyone) // self.depth))]
        shown = {id(r) for r in visible}
        held = [r for r in everyone if id(r) not in shown]
        sched.running = visible
        # Admissions count every running request, not only the visible ones.
        sched.config = replace(config, max_num_seqs=max(0, config.max_num_seqs - len(held)))
        try:
            return sched.schedule()
        finally:
            sched.config = config
            kept = {id(r) for r in sched.running}  # visible ones not preempted, and admitted
            before = {id(r) for r in everyone}
            sched.running = ([r for r in everyone if id(r) in kept or id(r) not in shown]
                             + [r for r in sched.running if id(r) not in before])

    # ---- land -----------------------------------------------------------------------------
    def _land(self, batch: MicroBatch) -> list[RequestDelta]:
        """Wait for a micro-batch's logits, then verify and commit it as `EngineCore.step`."""
        timer = batch.timer
        timer.restart()
        hidden: list = []  # per segment, its hidden_rows
        logits = self.runner.collect(batch.pending, hidden)
        timer.lap("target_forward")
        self._busy.difference_update(item.request.request_id for item in batch.scheduled)
        live = [i for i, item in enumerate(batch.scheduled)
                if item.request.request_id in self.requests]  # not aborted while in flight
        scheduled = [batch.scheduled[i] for i in live]
        segments = [batch.segments[i] for i in live]
        logits = [logits[i] for i in live]
        hidden = [hidden[i] for i in live]
        trees = {item.request.request_id: batch.trees[item.request.request_id]
                 for item in scheduled if item.request.request_id in batch.trees}
        verdicts = self._verify(scheduled, trees, segments, logits)
        timer.lap("verify")
        self._record_target_hidden(scheduled, segments, hidden, trees, verdicts)
        now = time.monotonic()
        deltas = [self._commit(item, tree, verdict,
                               batch.modes.get(item.request.request_id, OFF), now)
                  for item, tree, verdict in verdicts]
        self._score(scheduled, segments, logits, hidden, verdicts, deltas)
        timer.lap("commit")
        self._record_step(scheduled, timer, segments, batch.draft)
        return deltas
