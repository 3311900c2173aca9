"""`ClusterEngine` over a fake deployment handle (the layer below): deltas pass through (also
several in one message), a replica gone before its first delta is retried, one gone mid-stream
ends the stream with an error (Ray's or the gRPC channel's), an abort always ends the stream,
shutdown stops the handle, and bad input is refused at once."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

import grpc  # noqa: E402
from ray.exceptions import RayActorError  # noqa: E402

from specserve.cluster.gateway_engine import ClusterEngine  # noqa: E402
from specserve.cluster.replica import EngineFacts  # noqa: E402
from specserve.engine import EngineLimits, EngineStoppedError, ModelInfo  # noqa: E402
from specserve.outputs import RequestDelta  # noqa: E402
from specserve.sampling import SamplingParams  # noqa: E402
from specserve.speculation.modes import parse_speculation  # noqa: E402


class FakeCall:
    """One streaming call: yields its deltas, each in a list of its own as a replica that keeps
    up sends them (`batches` groups several into one list), or dies (`error`, by default
    RayActorError) after `die_after` lists."""

    def __init__(self, deltas: list[RequestDelta], die_after: int | None = None,
                 hold: bool = False, batches: list[list[RequestDelta]] | None = None,
                 error: Exception | None = None) -> None:
        self.batches = batches if batches is not None else [[d] for d in deltas]
        self.die_after, self.hold = die_after, hold
        self.error = error if error is not None else RayActorError()
        self.cancelled = False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        for i, batch in enumerate(self.batches):
            if i == self.die_after:
                raise self.error
            await asyncio.sleep(0)
            yield batch
        if self.die_after == len(self.batches):
            raise self.error
        while self.hold:  # a long generation, until cancelled
            await asyncio.sleep(0.01)

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    def __init__(self, *calls: FakeCall) -> None:
        self.calls, self.turns = list(calls), []
        self.options_set: dict = {}
        self.shut_down = False

    def options(self, **options):
        self.options_set.update(options)
        return self

    async def shutdown_async(self) -> None:
        self.shut_down = True

    @property
    def generate(self):
        return self

    def remote(self, turn):
        self.turns.append(turn)
        return self.calls.pop(0)


def engine(handle: FakeHandle, replicas: int = 2) -> ClusterEngine:
    info = ModelInfo(Path("t"), None, 100, parse_speculation("off", False))
    facts = EngineFacts(info, EngineLimits(64, 1024, 4), tokenizer=None)
    return ClusterEngine(handle, facts, replicas)


def delta(rid: str, tokens: list[int], reason: str | None = None) -> RequestDelta:
    return RequestDelta(rid, tokens, "x" * len(tokens), finish_reason=reason,
                        metrics={"replica": "r0"} if reason else None)


async def drain(stream) -> list[RequestDelta]:
    return [d async for d in stream]


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_deltas_pass_through_and_the_turn_names_its_session():
    handle = FakeHandle(FakeCall([delta("sess_1/a", [1, 2]), delta("sess_1/a", [3], "length")]))

    async def go():
        eng = engine(handle)
        await eng.start()
        stream = eng.add_request([5, 6, 7], SamplingParams(max_tokens=3), "sess_1/a")
        assert eng.num_in_flight() == 1
        out = await drain(stream)
        return eng, out

    eng, out = run(go())
    assert [d.token_ids for d in out] == [[1, 2], [3]] and out[-1].finish_reason == "length"
    assert eng.num_in_flight() == 0
    assert handle.turns[0].session == "sess_1" and handle.turns[0].prompt_token_ids == [5, 6, 7]
    assert eng.limits.max_num_seqs == 8  # admission counts every replica's batch slots


def test_replica_gone_before_any_delta_is_retried():
    handle = FakeHandle(FakeCall([], die_after=0), FakeCall([delta("a", [1], "stop")]))

    async def go():
        eng = engine(handle)
        await eng.start()
        return await drain(eng.add_request([1], SamplingParams(max_tokens=4), "a"))

    out = run(go())
    assert out[-1].finish_reason == "stop" and len(handle.turns) == 2


def test_replica_gone_mid_stream_ends_with_an_error():
    handle = FakeHandle(FakeCall([delta("a", [1]), delta("a", [2])], die_after=2))

    async def go():
        eng = engine(handle)
        await eng.start()
        return eng, await drain(eng.add_request([1], SamplingParams(max_tokens=9), "a"))

    eng, out = run(go())
    assert [d.token_ids for d in out[:2]] == [[1], [2]]
    assert out[-1].finish_reason == "error" and "replica" in out[-1].error
    assert len(handle.turns) == 1 and eng.num_in_flight() == 0  # no retry after output


@pytest.mark.parametrize("wait_first", [True, False])
def test_abort_ends_the_stream_and_cancels_the_call(wait_first):
    call = FakeCall([delta("a", [1])], hold=True)

    async def go():
        eng = engine(FakeHandle(call))
        await eng.start()
        stream = eng.add_request([1], SamplingParams(max_tokens=9), "a")
        if wait_first:  # mid-stream, else before the pump has even run
            first = await stream.queue.get()
            stream.queue.put_nowait(first)
        stream.abort()
        return eng, await drain(stream)

    eng, out = run(go())
    assert out[-1].finish_reason == "abort" and eng.num_in_flight() == 0
    assert call.cancelled == wait_first


def test_shutdown_ends_every_stream_and_stops_the_handle():
    handle = FakeHandle(FakeCall([], hold=True), FakeCall([], hold=True))

    async def go():
        eng = engine(handle)
        await eng.start()
        streams = [eng.add_request([1], SamplingParams(max_tokens=9), rid) for rid in "ab"]
        await asyncio.sleep(0.05)
        await eng.shutdown()
        return [await drain(s) for s in streams]

    assert [out[-1].finish_reason for out in run(go())] == ["abort", "abort"]
    assert handle.shut_down


def test_deltas_sent_together_arrive_one_by_one_in_order():
    batches = [[delta("a", [1]), delta("a", [2, 3]), delta("a", [4])],
               [delta("a", [5]), delta("a", [6], "length")]]
    handle = FakeHandle(FakeCall([], batches=batches))

    async def go():
        eng = engine(handle)
        await eng.start()
        return eng, await drain(eng.add_request([1], SamplingParams(max_tokens=6), "a"))

    eng, out = run(go())
    assert [d.token_ids for d in out] == [[1], [2, 3], [4], [5], [6]]
    assert out[-1].finish_reason == "length" and eng.num_in_flight() == 0


def test_calls_stream_over_grpc_with_plain_pickle():
    handle = FakeHandle()
    engine(handle)
    assert handle.options_set == {"stream": True, "_by_reference": False,
                                  "request_serialization": "pickle",
                                  "response_serialization": "pickle"}


def _broken_channel() -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(),
                                grpc.aio.Metadata(), details="connection reset")


def test_a_broken_grpc_channel_counts_as_a_dead_replica():
    before = FakeHandle(FakeCall([], die_after=0, error=_broken_channel()),
                        FakeCall([delta("a", [1], "stop")]))
    during = FakeHandle(FakeCall([delta("b", [1])], die_after=1, error=_broken_channel()))

    async def go():
        eng = engine(before)
        await eng.start()
        retried = await drain(eng.add_request([1], SamplingParams(max_tokens=4), "a"))
        eng = engine(during)
        await eng.start()
        return retried, await drain(eng.add_request([1], SamplingParams(max_tokens=4), "b"))

    retried, failed = run(go())
    assert retried[-1].finish_reason == "stop" and len(before.turns) == 2
    assert failed[0].token_ids == [1] and failed[-1].finish_reason == "error"
    assert "replica" in failed[-1].error and "AioRpcError" in failed[-1].error


def test_bad_requests_are_refused_at_once():
    async def go():
        eng = engine(FakeHandle())
        with pytest.raises(EngineStoppedError):
            eng.add_request([1], SamplingParams(max_tokens=4))
        await eng.start()
        with pytest.raises(ValueError, match="token ids"):
            eng.add_request([100], SamplingParams(max_tokens=4))
        with pytest.raises(ValueError, match="context"):
            eng.add_request([1] * 60, SamplingParams(max_tokens=10))
        with pytest.raises(ValueError, match="draft"):
            eng.add_request([1], SamplingParams(max_tokens=4), speculation="chain:3")

    run(go())
