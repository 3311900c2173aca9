"""`channel.batches`: a replica sends every delta its engine has ready in one message, in
order, and stops after the finished one; over a stream fed by hand (the engine's side)."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")

from specserve.cluster.channel import batches  # noqa: E402
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
