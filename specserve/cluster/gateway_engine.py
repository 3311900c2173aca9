"""`ClusterEngine`: the gateway's stand-in for `AsyncEngine`, so the routes run unchanged.

It has the face the routes use (`add_request` returning a stream, `abort`, `tokenizer`,
`model_info`, `limits`, `stats`, `kv_pool`, `num_in_flight`, `start`/`shutdown`), and behind
it each request is one streaming call to the engine replicas' deployment handle. The router
(`router.py`) picks the replica; `_pump` puts the replica's deltas on a `RemoteStream`.

The call goes over Serve's direct gRPC channel to the replica (`_by_reference=False`), not
through Ray's object store: a streamed item is then one gRPC message, where by reference each
is a Ray object with its own ownership and reference-counting RPCs (a toy deployment
streaming 64 items, on the 2-core bench machine at load 5: 1.1-1.4 ms against 2.9-3.6 ms from
the replica's yield to here, and about half the CPU here). Plain pickle, not cloudpickle: every
type that crosses is importable from this package.

Faults: a replica that dies before sending anything is retried on another (nothing was
streamed, so a second try cannot duplicate output); one that dies mid-stream ends the stream
with an error delta naming the failure. A stream never waits on a dead replica: Ray fails the
call when the actor dies.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from dataclasses import fields

from grpc.aio import AioRpcError
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.handle import DeploymentHandle

from ..engine import EngineLimits, EngineStats, EngineStoppedError, KVPoolStats, ModelInfo
from ..engine.async_engine import DeltaStream
from ..outputs import RequestDelta
from ..sampling import SamplingParams
from ..server.metrics import scheduler_counts
from ..speculation.modes import SpecMode, parse_speculation
from ..validation import RequestLimits, check_lengths, check_prompt_ids
from . import registry
from .replica import EngineFacts, Turn

log = logging.getLogger("specserve.cluster")

# A dead replica fails its calls with these: Ray's errors, or the gRPC channel's own when the
# connection broke with a status Serve does not translate.
_REPLICA_GONE = (RayActorError, ActorUnavailableError, AioRpcError)


class RemoteStream(DeltaStream):
    """One request's deltas from its replica, put on the queue by `ClusterEngine._pump`."""

    def __init__(self, request_id: str, prompt_token_ids: list[int]) -> None:
        super().__init__(request_id, prompt_token_ids)
        self.task: asyncio.Task | None = None  # the pump

    def abort(self) -> None:
        """The replica's generator is cancelled (its engine frees the blocks) and the stream
        ends with an `abort` delta."""
        if self.task is not None and not self.task.done():
            self.task.cancel()


class ClusterEngine:
    """The engine face of N replicas (see the module docstring)."""

    def __init__(self, handle: DeploymentHandle, facts: EngineFacts, num_replicas: int,
                 retries: int = 2, report_period_s: float = 1.0) -> None:
        self.handle = handle.options(stream=True, _by_reference=False,
                                     request_serialization="pickle",
                                     response_serialization="pickle")
        self.tokenizer = facts.tokenizer
        self.num_replicas = num_replicas
        self.retries = retries  # replicas tried after one died before streaming anything
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

    # ---- lifecycle ------------------------------------------------------------------------
    async def start(self) -> None:
        self._running = True

    async def shutdown(self) -> None:
        """Abort every request in flight, wait until each stream has ended, and stop the
        handle's router (it would otherwise poll Ray's controller for as long as this process
        lives)."""
        self._running = False
        tasks = [s.task for s in self._streams.values() if s.task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.handle.shutdown_async()

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
        """Each live replica's last report (`EngineReplica.record_routing_stats`), by id;
        empty until the first request has built the router."""
        router = registry.current_router()
        return {} if router is None else {rid: report for rid, report
                                          in router.replica_reports().items() if report}

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
        while its engine runs and its reports keep coming, else "stale"."""
        now = time.time()
        out = []
        for rid, report in sorted(self.replica_reports().items()):
            age = max(0.0, now - report["time"])
            in_flight = report["num_in_flight"]
            running, waiting = scheduler_counts(in_flight, report["max_num_seqs"])
            blocks, free = report["num_blocks"], report["num_free_blocks"]
            ok = report["running"] and age <= self.stale_after_s
            out.append({"replica": rid, "status": "ok" if ok else "stale",
                        "report_age_s": round(age, 3), "requests_in_flight": in_flight,
                        "requests_running": running, "requests_waiting": waiting,
                        "kv_blocks_total": blocks, "kv_blocks_free": free,
                        "kv_cache_usage_perc": 1.0 - free / blocks if blocks else 0.0,
                        "prefix_cache_hit_rate": report["prefix_hit_rate"],
                        "memory_bytes": report["rss_bytes"]})
        return out

    def replica_health(self) -> dict:
        """/health behind the gateway: "ok" with every replica healthy, "degraded" with some
        (it still serves), "unavailable" with none; and each replica's entry."""
        replicas = self.replicas()
        healthy = sum(r["status"] == "ok" for r in replicas)
        status = ("ok" if healthy >= self.num_replicas else "degraded" if healthy
                  else "unavailable")
        return {"status": status, "replicas_expected": self.num_replicas,
                "replicas_healthy": healthy, "replicas": replicas}

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
        """Replica deltas -> the stream's queue, ending with exactly one finished delta."""
        rid = turn.request_id
        sent_any, call = False, None
        try:
            for attempt in range(self.retries + 1):
                call = self.handle.generate.remote(turn)
                try:
                    async for batch in call:  # replica.batches: one list per message
                        sent_any = True
                        for delta in batch:
                            self._deliver(stream, delta)
                    if self._streams.get(rid) is stream:  # no finished delta came
                        self._deliver(stream, _error(rid, "the replica's stream ended early"))
                    return
                except _REPLICA_GONE as exc:
                    if sent_any or attempt == self.retries:
                        log.warning("request %s: replica failed: %s", rid, exc)
                        self._deliver(stream, _error(rid, f"the engine replica serving this "
                                                          f"request failed ({type(exc).__name__})"))
                        return
                    await asyncio.sleep(0.1 * (attempt + 1))  # Ray drops the dead replica
        except asyncio.CancelledError:
            # abort() or shutdown: stop the replica's generator (its engine frees the blocks).
            if call is not None:
                call.cancel()
            self._deliver(stream, RequestDelta(rid, [], "", finish_reason="abort"))
        except Exception as exc:  # a failure inside the replica, or a bug: never a hang
            log.exception("request %s failed", rid)
            self._deliver(stream, _error(rid, f"engine replica error: {exc}"))

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
