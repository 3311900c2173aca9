"""`ClusterEngine`: the gateway's stand-in for `AsyncEngine`, so the routes run unchanged.

It has the face the routes use (`add_request` returning a stream, `abort`, `tokenizer`,
`model_info`, `limits`, `stats`, `kv_pool`, `num_in_flight`, `start`/`shutdown`). Behind it,
each request goes to the replica the routing policy (`router.py`) picks among the live ones
Ray Serve reports, over that replica's connection (`channel.py`, opened on first use), and
`_pump` waits for its end while the connection's reader puts the deltas on its `RemoteStream`.

Faults: a turn whose replica is unreachable, or whose connection ends before anything was
streamed, is retried on another replica (nothing was streamed, so a second try cannot
duplicate output); one whose connection ends mid-stream ends with an error delta naming the
failure. A stream never waits on a dead replica: its connection ends with the process.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import fields

from ray.serve.handle import DeploymentHandle

from ..engine import EngineLimits, EngineStats, EngineStoppedError, KVPoolStats, ModelInfo
from ..engine.async_engine import DeltaStream
from ..outputs import RequestDelta
from ..sampling import SamplingParams
from ..server.metrics import scheduler_counts
from ..speculation.modes import SpecMode, parse_speculation
from ..validation import RequestLimits, check_lengths, check_prompt_ids
from . import registry
from .app import PREFILL, REPLICAS
from .channel import ReplicaConnection, ReplicaGone, Turn
from .replica import EngineFacts
from .router import Candidate, LiveReplica, RoutingPolicy

log = logging.getLogger("specserve.cluster")


class NoReplica(RuntimeError):
    """No live replica to send a turn to."""


def registered_replicas() -> list[LiveReplica]:
    """The live engine replicas as this process's `ReplicaSet` knows them (none before it is
    built)."""
    replica_set = registry.current_router(REPLICAS)
    return [] if replica_set is None else replica_set.live()


def registered_prefill_reports() -> dict[str, dict]:
    """The prefill replicas' last reports, by id (none before their `ReplicaSet` is built)."""
    replica_set = registry.current_router(PREFILL)
    return {} if replica_set is None else replica_set.reports()


class RemoteStream(DeltaStream):
    """One request's deltas from its replica, put on the queue by `ClusterEngine._pump`."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        super().__init__(request_id, prompt_token_ids)
        self.task: asyncio.Task | None = None  # the pump
        self.started = False  # a delta came: the turn may no longer be retried

    def abort(self) -> None:
        """The turn is aborted on its replica (its engine frees the blocks) and the stream
        ends with an `abort` delta."""
        if self.task is not None and not self.task.done():
            self.task.cancel()


class ClusterEngine:
    """The engine face of N replicas (see the module docstring)."""

    def __init__(self, handle: DeploymentHandle, facts: EngineFacts, num_replicas: int,
                 stream_token: str, router: RoutingPolicy, retries: int = 2,
                 report_period_s: float = 1.0,
                 live: Callable[[], list[LiveReplica]] = registered_replicas,
                 wait_for_replica_s: float = 30.0, prefill_handle: DeploymentHandle | None = None,
                 num_prefill_replicas: int = 0,
                 prefill_reports: Callable[[], dict[str, dict]] = registered_prefill_reports,
                 ) -> None:
        self.handle = handle  # its router keeps the live replicas (`live`) current
        # With a prefill pool: its handle's router keeps the prefill replicas' reports.
        self.prefill_handle = prefill_handle
        self.num_prefill_replicas = num_prefill_replicas
        self.prefill_reports = prefill_reports
        self.stream_token = stream_token
        self.router = router  # the routing policy (router.py)
        self.live = live
        self.tokenizer = facts.tokenizer
        self.num_replicas = num_replicas
        self.retries = retries  # replicas tried after one died before streaming anything
        # With no live replica (all restarting), a turn waits this long for one.
        self.wait_for_replica_s = wait_for_replica_s
        self.unreachable_s = 5.0  # a replica whose connection failed is left alone this long
        # A replica whose last report is older than this is hung or cut off: not healthy.
        # (Reports travel replica -> Ray's controller -> this process, so allow for slack.)
        self.stale_after_s = 5 * report_period_s + 5.0
        self._model_info = facts.model_info
        one = facts.limits
        # A request's context is one replica's; the batch slots (admission control's
        # measure) are every replica's together.
        self._limits = EngineLimits(one.max_model_len, one.kv_pool_tokens,
                                    one.max_num_seqs * num_replicas)
        self._request_limits = RequestLimits.for_context(
            min(one.max_model_len, one.kv_pool_tokens))
        self._streams: dict[str, RemoteStream] = {}
        self._running = False
        self._connections: dict[str, asyncio.Task] = {}  # replica id -> its opening
        self._queues: Counter[str] = Counter()  # replica id -> turns in flight there
        self._unreachable: dict[str, float] = {}  # replica id -> when its connection failed
        self.watch_period_s = 1.0  # how often connections are checked against the live set
        self._watch: asyncio.Task | None = None

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._running = True
        self._watch = asyncio.get_running_loop().create_task(self._watch_replicas())

    async def shutdown(self) -> None:
        """Abort every request in flight, wait until each stream has ended, close the
        connections, and stop the handle's router (it would otherwise poll Ray's controller for
        as long as this process lives)."""
        self._running = False
        if self._watch is not None:
            self._watch.cancel()
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for replica_id in list(self._connections):
            self._close(replica_id)
        await self.handle.shutdown_async()
        if self.prefill_handle is not None:
            await self.prefill_handle.shutdown_async()

    @property
    def running(self) -> bool:
        return self._running

    # ---- read-only views ------------------------------------------------------------------
    @property
    def model_info(self) -> ModelInfo:
        return self._model_info

    @property
    def limits(self) -> EngineLimits:
        return self._limits

    def replica_reports(self) -> dict[str, dict]:
        """Each live replica's last report (`EngineReplica.record_routing_stats`), by id."""
        return {r.replica_id: r.report for r in self.live() if r.report}

    @property
    def stats(self) -> EngineStats:
        """Every live replica's counters summed (as of their last reports)."""
        total = EngineStats()
        for report in self.replica_reports().values():
            for f in fields(EngineStats):
                value = report["stats"][f.name]
                if isinstance(value, list):
                    mine = getattr(total, f.name)
                    mine.extend([0] * (len(value) - len(mine)))
                    for i, v in enumerate(value):
                        mine[i] += v
                else:
                    setattr(total, f.name, getattr(total, f.name) + value)
        return total

    def kv_pool(self) -> KVPoolStats:
        """The replicas' pools together. Each replica reports a hit rate, not its lookups, so
        the rates are weighted by the requests each replica finished."""
        reports = list(self.replica_reports().values())
        finished = sum(r["stats"]["num_finished"] for r in reports)
        hit_rate = (sum(r["prefix_hit_rate"] * r["stats"]["num_finished"] for r in reports)
                    / finished if finished else 0.0)
        return KVPoolStats(sum(r["num_blocks"] for r in reports),
                           sum(r["num_free_blocks"] for r in reports), hit_rate)

    def replicas(self) -> list[dict]:
        """Each live replica as of its last report, for /health and /metrics: `status` is "ok"
        while its engine runs and its reports keep coming, "unreachable" for a while after its
        connection failed (Serve may not have noticed its end yet), else "stale"."""
        now, clock = time.time(), time.monotonic()  # reports carry wall-clock times
        out = []
        for rid, report in sorted(self.replica_reports().items()):
            age = max(0.0, now - report["time"])
            in_flight = report["num_in_flight"]
            running, waiting = scheduler_counts(in_flight, report["max_num_seqs"])
            blocks, free = report["num_blocks"], report["num_free_blocks"]
            ok = report["running"] and age <= self.stale_after_s
            status = ("unreachable" if self._unreachable_now(rid, clock)
                      else "ok" if ok else "stale")
            out.append({"replica": rid, "status": status,
                        "report_age_s": round(age, 3), "requests_in_flight": in_flight,
                        "requests_running": running, "requests_waiting": waiting,
                        "kv_blocks_total": blocks, "kv_blocks_free": free,
                        "kv_cache_usage_perc": 1.0 - free / blocks if blocks else 0.0,
                        "prefix_cache_hit_rate": report["prefix_hit_rate"],
                        "memory_bytes": report["rss_bytes"]})
        return out

    def prefill_replicas(self) -> list[dict]:
        """Each live prefill replica as of its last report, for /health: `status` as for the
        engine replicas ("ok" or "stale")."""
        now = time.time()
        out = []
        for rid, report in sorted(self.prefill_reports().items()):
            age = max(0.0, now - report["time"])
            blocks, free = report["num_blocks"], report["num_free_blocks"]
            ok = report["running"] and age <= self.stale_after_s
            out.append({"replica": rid, "status": "ok" if ok else "stale",
                        "report_age_s": round(age, 3),
                        "requests_in_flight": report["num_in_flight"],
                        "kv_blocks_total": blocks, "kv_blocks_free": free,
                        "kv_cache_usage_perc": 1.0 - free / blocks if blocks else 0.0,
                        "transfers_held": report["num_held"],
                        "memory_bytes": report["rss_bytes"]})
        return out

    def replica_health(self) -> dict:
        """/health behind the gateway: "ok" with every replica healthy, "degraded" with some
        (it still serves), "unavailable" with no engine replica healthy, or no prefill replica
        where there is a prefill pool; and each replica's entry."""
        replicas = self.replicas()
        healthy = sum(r["status"] == "ok" for r in replicas)
        body = {"replicas_expected": self.num_replicas, "replicas_healthy": healthy,
                "replicas": replicas}
        short = healthy < self.num_replicas
        if self.num_prefill_replicas:
            prefill = self.prefill_replicas()
            prefill_healthy = sum(r["status"] == "ok" for r in prefill)
            body.update(prefill_replicas_expected=self.num_prefill_replicas,
                        prefill_replicas_healthy=prefill_healthy, prefill_replicas=prefill)
            short = short or prefill_healthy < self.num_prefill_replicas
            healthy = min(healthy, prefill_healthy)
        status = "unavailable" if not healthy else "degraded" if short else "ok"
        return {"status": status, **body}

    def request_counts(self) -> tuple[int, int]:
        """(running, waiting) over the cluster, vLLM's meanings: each replica's scheduler
        split, plus requests the gateway holds that no replica has reported yet (waiting)."""
        replicas = self.replicas()
        running = sum(r["requests_running"] for r in replicas)
        waiting = sum(r["requests_waiting"] for r in replicas)
        unplaced = self.num_in_flight() - sum(r["requests_in_flight"] for r in replicas)
        return running, waiting + max(0, unplaced)

    def parse_speculation(self, value) -> SpecMode:
        return parse_speculation(value, self._model_info.has_draft)

    def num_in_flight(self) -> int:
        return len(self._streams)

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None, speculation=None) -> RemoteStream:
        """Check what the engine would check (ValueError), then stream it from a replica."""
        if not self._running:
            raise EngineStoppedError("the engine is not running")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_prompt_ids(ids, self._model_info.vocab_size)
        check_lengths(len(ids), params.max_tokens, self._request_limits)
        if speculation is not None:
            self.parse_speculation(speculation)
        request_id = request_id if request_id is not None else f"req-{secrets.token_hex(8)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        stream = self._streams[request_id] = RemoteStream(request_id, ids)
        turn = Turn(ids, params, request_id, speculation, _session(request_id))
        stream.task = asyncio.get_running_loop().create_task(self._pump(stream, turn))
        # A task cancelled before it first ran never enters _pump's handlers: end it here.
        stream.task.add_done_callback(
            lambda _: self._deliver(stream, RequestDelta(request_id, [], "",
                                                         finish_reason="abort")))
        return stream

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            stream.abort()

    async def _pump(self, stream: RemoteStream, turn: Turn) -> None:
        """Send the turn to a replica and wait for its end; exactly one finished delta."""
        rid = turn.request_id
        connection = None

        def deliver(delta: RequestDelta) -> None:
            stream.started = True
            self._deliver(stream, delta)

        try:
            for attempt in range(self.retries + 1):
                replica = await self._choose(turn)
                try:
                    connection = await self._connection(replica)
                    self._queues[replica.replica_id] += 1
                    try:
                        await connection.start(turn, deliver)
                    finally:
                        self._queues[replica.replica_id] -= 1
                    return
                except (ReplicaGone, OSError) as exc:  # OSError: it did not answer at all
                    self._lost(replica.replica_id)
                    if stream.started or attempt == self.retries:
                        log.warning("request %s: replica %s failed: %s", rid,
                                    replica.replica_id, exc)
                        self._deliver(stream, _error(rid, f"the engine replica serving this "
                                                          f"request failed: {exc}"))
                        return
                    await asyncio.sleep(0.1 * (attempt + 1))  # Serve drops the dead replica
        except asyncio.CancelledError:
            # abort() or shutdown: stop the turn on its replica (its engine frees the blocks).
            if connection is not None:
                connection.abort(rid)
            self._deliver(stream, RequestDelta(rid, [], "", finish_reason="abort"))
        except Exception as exc:  # no replica, or a bug: never a hang
            if not isinstance(exc, NoReplica):
                log.exception("request %s failed", rid)
            self._deliver(stream, _error(rid, f"engine replica error: {exc}"))

    async def _choose(self, turn: Turn) -> LiveReplica:
        """The replica for `turn`: the policy's pick among the reachable live replicas, waiting
        up to `wait_for_replica_s` while there is none."""
        deadline = time.monotonic() + self.wait_for_replica_s
        while True:
            now = time.monotonic()
            live = [r for r in self.live() if not self._unreachable_now(r.replica_id, now)]
            if live:
                break
            if now > deadline:
                raise NoReplica("no engine replica is available")
            await asyncio.sleep(0.05)
        by_id = {r.replica_id: r for r in live}
        choice = self.router.choose(turn, [Candidate(r.replica_id, self._queues[r.replica_id],
                                                     r.capacity) for r in live])
        self.router.routed(turn, choice.replica_id)
        return by_id[choice.replica_id]

    async def _connection(self, replica: LiveReplica) -> ReplicaConnection:
        """The open connection to `replica`, opened once and shared by its turns."""
        opening = self._connections.get(replica.replica_id)
        if opening is None or (opening.done() and (
                opening.cancelled() or opening.exception() is not None
                or opening.result().closed)):
            opening = self._connections[replica.replica_id] = asyncio.ensure_future(
                self._open(replica))
        # Shielded: a turn aborted while the connection opens must not cancel it for others.
        return await asyncio.shield(opening)

    async def _open(self, replica: LiveReplica) -> ReplicaConnection:
        connection = await ReplicaConnection.open(replica.host, replica.port, self.stream_token)
        connection.when_closed(lambda: self._lost(replica.replica_id) if self._running else None)
        return connection

    async def _watch_replicas(self) -> None:
        """Close the connection of each replica Serve no longer lists (dead, or failing its
        health checks): a machine that vanished sends no end of stream, and the turns on its
        connection would wait for it forever."""
        while True:
            await asyncio.sleep(self.watch_period_s)
            live = {r.replica_id for r in self.live()}
            for replica_id in [rid for rid in self._connections if rid not in live]:
                self._close(replica_id, "the replica is gone (Ray Serve no longer lists it)")

    def _close(self, replica_id: str, reason: str | None = None) -> None:
        """Close the connection to `replica_id` (once open, if it is still opening: the turns
        waiting for it then fail over as from a closed one)."""
        def close(opening: asyncio.Future) -> None:
            if not opening.cancelled() and opening.exception() is None:
                opening.result().close(reason)

        self._connections.pop(replica_id).add_done_callback(close)

    def _lost(self, replica_id: str) -> None:
        """Its connection failed: leave the replica alone a while, forget what it cached."""
        self._unreachable[replica_id] = time.monotonic()
        self.router.forget(replica_id)

    def _unreachable_now(self, replica_id: str, now: float) -> bool:
        return now - self._unreachable.get(replica_id, -self.unreachable_s) < self.unreachable_s

    def _deliver(self, stream: RemoteStream, delta: RequestDelta) -> None:
        if self._streams.get(stream.request_id) is not stream:
            return  # already finished
        if delta.finished:
            del self._streams[stream.request_id]
        stream.queue.put_nowait(delta)


def _error(request_id: str, message: str) -> RequestDelta:
    return RequestDelta(request_id, [], "", finish_reason="error", error=message)


def _session(request_id: str) -> str | None:
    """The conversation a request belongs to: a WebSocket session names its engine requests
    `<session id>/<request id>` (ws.py); other requests stand alone."""
    session, sep, _ = request_id.partition("/")
    return session if sep else None
