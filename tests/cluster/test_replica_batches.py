"""`channel.batches`: a replica sends every delta its engine has ready in one message, in
order, and stops after the finished one; over a stream fed by hand (the engine's side). And
`channel.Outbox`: what several turns on one connection send in one pass of the event loop
goes out as one frame, a lone turn's at once."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

from specserve.cluster.channel import Outbox, batches  # noqa: E402
from specserve.engine.async_engine import DeltaStream  # noqa: E402
from specserve.outputs import RequestDelta  # noqa: E402


def delta(tokens: list[int], reason: str | None = None) -> RequestDelta:
    return RequestDelta("r", tokens, "x" * len(tokens), finish_reason=reason)


def test_ready_deltas_go_together_and_later_ones_alone():
    async def go():
        stream = DeltaStream("r", [1, 2])
        for d in (delta([1]), delta([2]), delta([3])):  # the engine ran ahead of the sender
            stream.queue.put_nowait(d)
        out = []
        async for batch in batches(stream):
            out.append([d.token_ids for d in batch])
            if len(out) == 1:  # the sender caught up: the next steps arrive one at a time
                asyncio.get_running_loop().call_later(0.01, stream.queue.put_nowait,
                                                      delta([4]))
            elif len(out) == 2:
                stream.queue.put_nowait(delta([5], "length"))
        return stream, out

    stream, out = asyncio.run(asyncio.wait_for(go(), 5))
    assert out == [[[1], [2], [3]], [[4]], [[5]]]
    assert stream.finished


def test_nothing_after_the_finished_delta_is_sent():
    async def go():
        stream = DeltaStream("r", [1])
        for d in (delta([1]), delta([2], "stop"), delta([9])):
            stream.queue.put_nowait(d)
        return [[d.token_ids for d in batch] async for batch in batches(stream)]

    assert asyncio.run(asyncio.wait_for(go(), 5)) == [[[1], [2]]]


class FakeWriter:
    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def is_closing(self) -> bool:
        return False

    def write(self, frame: bytes) -> None:
        self.frames.append(frame)


def test_turns_sending_in_one_pass_share_a_frame_and_a_lone_turn_writes_at_once():
    import msgspec

    def decoded(frame: bytes) -> list[list[int]]:
        return [d.token_ids for d in msgspec.msgpack.decode(frame[4:], type=list[RequestDelta])]

    async def go():
        writer, turns = FakeWriter(), {"a": None}
        outbox = Outbox(writer, turns)
        outbox.send([delta([1])])
        assert [decoded(f) for f in writer.frames] == [[[1]]]  # alone: no wait
        turns["b"] = None
        outbox.send([delta([2])])
        outbox.send([delta([3]), delta([4])])
        assert len(writer.frames) == 1  # held for the rest of this pass
        await asyncio.sleep(0)
        return [decoded(f) for f in writer.frames]

    assert asyncio.run(go()) == [[[1]], [[2], [3], [4]]]
