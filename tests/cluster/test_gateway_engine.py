"""`ClusterEngine` and the stream channel between it and the replicas, without Ray: each fake
replica is the real `StreamServer` on 127.0.0.1 over a fake engine (the layer below) that
streams scripted deltas. Deltas pass through (also several in one frame), the turn and its
parameters cross intact, a replica unreachable or gone before its first delta is retried on
another, one gone mid-stream ends the stream with an error, an abort always ends the stream
and aborts the turn on its replica, a wrong token or an oversized first frame is refused,
shutdown closes everything, bad input is refused at once, and /health counts both pools."""

from __future__ import annotations

import asyncio
import dataclasses
import struct
import time
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

from specserve.cluster.channel import StreamServer, Turn  # noqa: E402
from specserve.cluster.gateway_engine import ClusterEngine  # noqa: E402
from specserve.cluster.replica import EngineFacts  # noqa: E402
from specserve.cluster.router import LiveReplica, PrefixAffinityRouter  # noqa: E402
from specserve.engine import EngineLimits, EngineStoppedError, ModelInfo  # noqa: E402
from specserve.engine.async_engine import DeltaStream  # noqa: E402
from specserve.outputs import RequestDelta  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.speculation.modes import parse_speculation  # noqa: E402

TOKEN = "secret"
DIE, HOLD = "die", "hold"  # script steps: the replica's process ends; the turn runs on


class FakeStream(DeltaStream):
    def __init__(self, engine: FakeEngine, rid: str) -> None:
        super().__init__(rid, [])
        self.engine = engine

    def abort(self) -> None:
        if not self.finished:
            self.engine.aborted.append(self.request_id)
            self.queue.put_nowait(RequestDelta(self.request_id, [], "", finish_reason="abort"))


class FakeEngine:
    """Streams each request's script: lists of token lists (one list: put on the queue at
    once), `DIE` (the replica goes away) or `HOLD` (runs until aborted)."""

    def __init__(self, *steps) -> None:
        self.steps = steps
        self.server: StreamServer | None = None
        self.requests: list[tuple] = []
        self.aborted: list[str] = []

    def add_request(self, ids, params, rid, speculation) -> FakeStream:
        self.requests.append((ids, params, rid, speculation))
        stream = FakeStream(self, rid)
        asyncio.get_running_loop().create_task(self._feed(stream))
        return stream

    async def _feed(self, stream: FakeStream) -> None:
        for i, step in enumerate(self.steps):
            await asyncio.sleep(0.01)
            if step == DIE:
                await self.server.close()
                return
            if step == HOLD:
                return
            last = i == len(self.steps) - 1
            for j, tokens in enumerate(step):
                finished = last and j == len(step) - 1
                stream.queue.put_nowait(RequestDelta(
                    stream.request_id, tokens, "x" * len(tokens),
                    finish_reason="length" if finished else None))


class Replicas:
    """Fake replicas on 127.0.0.1, as the gateway's live set."""

    def __init__(self) -> None:
        self.live: list[LiveReplica] = []
        self.servers: list[StreamServer] = []

    async def add(self, name: str, engine: FakeEngine, token: str = TOKEN) -> None:
        server = engine.server = StreamServer(engine, name, token)
        port = await server.start("127.0.0.1")
        self.servers.append(server)
        self.live.append(LiveReplica(name, "127.0.0.1", port, 8, {}))

    async def close(self) -> None:
        for server in self.servers:
            await server.close()


class FakeHandle:
    shut_down = False

    async def shutdown_async(self) -> None:
        self.shut_down = True


def keep_to(eng: ClusterEngine, session: str, replica: str) -> None:
    """The conversation `session` was on `replica`: its next turns go there."""
    eng.router.routed(Turn([1], SamplingParams(), f"{session}/0", None, session), replica)


def cluster_engine(replicas: Replicas, **options) -> ClusterEngine:
    info = ModelInfo(Path("t"), None, 100, parse_speculation("off", False))
    facts = EngineFacts(info, EngineLimits(64, 1024, 4), tokenizer=None)
    return ClusterEngine(FakeHandle(), facts, 2, TOKEN, PrefixAffinityRouter(),
                         live=lambda: replicas.live, **options)


async def drain(stream) -> list[RequestDelta]:
    return [d async for d in stream]


def run(test) -> None:
    """`test(replicas)` in a fresh loop, the fake replicas closed after."""
    async def go():
        replicas = Replicas()
        try:
            await asyncio.wait_for(test(replicas), 10)
        finally:
            await replicas.close()

    asyncio.run(go())


def test_deltas_pass_through_and_the_turn_crosses_intact():
    async def test(replicas):
        engine = FakeEngine([[1, 2]], [[3]])
        await replicas.add("r0", engine)
        eng = cluster_engine(replicas)
        await eng.start()
        params = SamplingParams(temperature=0, max_tokens=3, stop=("\n",), seed=5)
        stream = eng.add_request([5, 6, 7], params, "sess_1/a", speculation="ngram:3")
        assert eng.num_in_flight() == 1
        out = await drain(stream)
        assert [d.token_ids for d in out] == [[1, 2], [3]] and out[-1].finish_reason == "length"
        assert out[-1].metrics == {"replica": "r0"}
        assert engine.requests == [([5, 6, 7], params, "sess_1/a", "ngram:3")]
        assert eng.router.sessions["sess_1"] == "r0"  # the conversation keeps to r0
        assert eng.num_in_flight() == 0 and eng.limits.max_num_seqs == 8  # every replica's

    run(test)


def test_deltas_sent_together_arrive_one_by_one_in_order():
    async def test(replicas):
        await replicas.add("r0", FakeEngine([[1], [2, 3], [4]], [[5], [6]]))
        eng = cluster_engine(replicas)
        await eng.start()
        out = await drain(eng.add_request([1], SamplingParams(max_tokens=6), "a"))
        assert [d.token_ids for d in out] == [[1], [2, 3], [4], [5], [6]]
        assert out[-1].finish_reason == "length"

    run(test)


def test_a_replica_unreachable_or_gone_before_any_delta_is_retried():
    async def test(replicas):
        await replicas.add("dead", FakeEngine(DIE))
        await replicas.add("ok", FakeEngine([[1]]))
        await replicas.add("closed", FakeEngine([[1]]))
        await replicas.servers[-1].close()  # nothing listens there any more
        eng = cluster_engine(replicas)
        await eng.start()
        keep_to(eng, "s", "dead")
        keep_to(eng, "t", "closed")
        for rid in ("s/a", "t/b", "c"):
            out = await drain(eng.add_request([1], SamplingParams(max_tokens=4), rid))
            assert out[-1].finish_reason == "length" and out[-1].metrics["replica"] == "ok"
        assert [len(r.engine.requests) for r in replicas.servers] == [1, 3, 0]

    run(test)


def test_a_replica_gone_mid_stream_ends_the_stream_with_an_error():
    async def test(replicas):
        await replicas.add("r0", FakeEngine([[1]], [[2]], DIE))
        await replicas.add("r1", FakeEngine([[1]]))
        eng = cluster_engine(replicas)
        await eng.start()
        keep_to(eng, "s", "r0")
        out = await drain(eng.add_request([1], SamplingParams(max_tokens=9), "s/a"))
        assert [d.token_ids for d in out[:2]] == [[1], [2]]
        assert out[-1].finish_reason == "error" and "replica" in out[-1].error
        assert "closed the connection" in out[-1].error
        assert len(replicas.servers[1].engine.requests) == 0  # no retry after output
        assert eng.num_in_flight() == 0

    run(test)


def test_a_replica_ray_no_longer_lists_ends_its_streams():
    """A replica whose machine vanished sends no end of stream: once Serve drops it from the
    live set, the gateway closes its connection (a turn not yet started goes elsewhere)."""
    async def test(replicas):
        await replicas.add("r0", FakeEngine([[1]], HOLD))
        await replicas.add("r1", FakeEngine([[2]]))
        eng = cluster_engine(replicas)
        eng.watch_period_s = 0.05
        await eng.start()
        keep_to(eng, "s", "r0")
        stream = eng.add_request([1], SamplingParams(max_tokens=9), "s/a")
        first = await stream.queue.get()
        stream.queue.put_nowait(first)
        replicas.live.pop(0)  # Serve dropped r0; its process (here: its server) lingers
        out = await drain(stream)
        assert out[0].token_ids == [1] and out[-1].finish_reason == "error"
        assert "no longer lists it" in out[-1].error
        out = await drain(eng.add_request([1], SamplingParams(max_tokens=9), "s/b"))
        assert out[-1].metrics["replica"] == "r1"
        await eng.shutdown()

    run(test)


@pytest.mark.parametrize("wait_first", [True, False])
def test_abort_ends_the_stream_and_the_turn_on_its_replica(wait_first):
    async def test(replicas):
        engine = FakeEngine([[1]], HOLD)
        await replicas.add("r0", engine)
        eng = cluster_engine(replicas)
        await eng.start()
        stream = eng.add_request([1], SamplingParams(max_tokens=9), "a")
        if wait_first:  # mid-stream, else before the pump has even run
            first = await stream.queue.get()
            stream.queue.put_nowait(first)
        stream.abort()
        out = await drain(stream)
        assert out[-1].finish_reason == "abort" and eng.num_in_flight() == 0
        if wait_first:  # the replica's engine is told (the turn never got there otherwise)
            for _ in range(100):
                if engine.aborted:
                    break
                await asyncio.sleep(0.01)
            assert engine.aborted == ["a"]
        # The connection still serves the next turn.
        engine.steps = ([[2]],)
        out = await drain(eng.add_request([1], SamplingParams(max_tokens=9), "b"))
        assert out[-1].finish_reason == "length"

    run(test)


def test_shutdown_ends_every_stream_and_stops_the_handle():
    async def test(replicas):
        engine = FakeEngine(HOLD)
        await replicas.add("r0", engine)
        eng = cluster_engine(replicas)
        await eng.start()
        streams = [eng.add_request([1], SamplingParams(max_tokens=9), rid) for rid in "ab"]
        await asyncio.sleep(0.05)
        await eng.shutdown()
        assert [(await drain(s))[-1].finish_reason for s in streams] == ["abort", "abort"]
        assert eng.handle.shut_down
        for _ in range(100):  # the closed connection aborted both turns on the replica
            if len(engine.aborted) == 2:
                break
            await asyncio.sleep(0.01)
        assert sorted(engine.aborted) == ["a", "b"]

    run(test)


def test_a_replica_refuses_a_connection_without_its_token():
    async def test(replicas):
        await replicas.add("r0", FakeEngine([[1]]), token="another")
        eng = cluster_engine(replicas, retries=0)
        await eng.start()
        out = await drain(eng.add_request([1], SamplingParams(max_tokens=4), "a"))
        # Closed after the hello: the gateway reads an end, or a reset of what it sent after.
        assert out[-1].finish_reason == "error" and "connection" in out[-1].error
        assert replicas.servers[0].engine.requests == []

    run(test)


def test_a_replica_closes_a_connection_whose_first_frame_is_too_long():
    async def test(replicas):
        await replicas.add("r0", FakeEngine([[1]]))
        reader, writer = await asyncio.open_connection("127.0.0.1", replicas.live[0].port)
        writer.write(struct.pack("!I", 1 << 30))  # a gigabyte would follow: not waited for
        assert await asyncio.wait_for(reader.read(), 5) == b""
        writer.close()

    run(test)


def test_without_a_live_replica_a_turn_fails_after_the_wait():
    async def test(replicas):
        eng = cluster_engine(replicas, wait_for_replica_s=0.2)
        await eng.start()
        out = await drain(eng.add_request([1], SamplingParams(max_tokens=4), "a"))
        assert out[-1].finish_reason == "error"
        assert "no engine replica is available" in out[-1].error

    run(test)


def test_bad_requests_are_refused_at_once():
    async def test(replicas):
        eng = cluster_engine(replicas)
        with pytest.raises(EngineStoppedError):
            eng.add_request([1], SamplingParams(max_tokens=4))
        await eng.start()
        with pytest.raises(ValueError, match="token ids"):
            eng.add_request([100], SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="context"):
            eng.add_request([1] * 60, SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="draft"):
            eng.add_request([1], SamplingParams(max_tokens=4), speculation="chain:3")

    run(test)


def test_health_counts_each_pool():
    """/health's status: every replica of both pools healthy is "ok", some short "degraded",
    no engine replica or no prefill replica "unavailable"; a stale report is not healthy."""
    async def test(replicas):
        await replicas.add("e0", FakeEngine([[1]]))
        now = time.time()
        engine_report = {"time": now, "running": True, "num_in_flight": 0, "max_num_seqs": 4,
                         "num_blocks": 8, "num_free_blocks": 8, "prefix_hit_rate": 0.0,
                         "rss_bytes": 1, "stats": {}}
        replicas.live[0] = dataclasses.replace(replicas.live[0], report=engine_report)
        prefill = {"p0": {"time": now, "running": True, "num_in_flight": 1, "num_blocks": 8,
                          "num_free_blocks": 6, "num_held": 1, "rss_bytes": 2}}
        eng = cluster_engine(replicas, num_prefill_replicas=2,
                             prefill_reports=lambda: prefill)
        eng.num_replicas = 1
        body = eng.replica_health()
        assert (body["status"], body["prefill_replicas_healthy"]) == ("degraded", 1)
        assert body["prefill_replicas"][0] == {
            "replica": "p0", "status": "ok", "report_age_s": body["prefill_replicas"][0][
                "report_age_s"], "requests_in_flight": 1, "kv_blocks_total": 8,
            "kv_blocks_free": 6, "kv_cache_usage_perc": 0.25, "transfers_held": 1,
            "memory_bytes": 2}
        prefill["p1"] = {**prefill["p0"]}
        assert eng.replica_health()["status"] == "ok"
        for report in prefill.values():
            report["time"] = now - 60  # both stopped reporting
        assert eng.replica_health()["status"] == "unavailable"

    run(test)
