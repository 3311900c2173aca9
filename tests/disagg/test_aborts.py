"""A client that aborts frees its request's KV blocks on both sides at once, not when a time to
live runs out: while the prefill server computes (the decode server closes its HTTP request),
mid-transfer (the decode server sends a release) and mid-decode; and a prefill cancelled at any
moment leaves nothing held.

The prefill server is a real uvicorn on a thread; the decode engine runs in the test's loop."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from specserve import LLM, SamplingParams
from specserve.disagg.decode import DecodeEngine, PrefillClient
from specserve.disagg.prefill import ROUTES, PrefillEngine
from specserve.disagg.transport import TcpKVClient
from specserve.server import create_app
from tests.server.server_helpers import ServerThread

pytestmark = pytest.mark.timeout(120)

LONG = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
PROMPT = list(range(5, 45))  # 40 tokens: 5 blocks of 8


@pytest.fixture(scope="module")
def prefill_server(tiny_target):
    engine = PrefillEngine(LLM(tiny_target, num_blocks=32, block_size=8).engine)
    server = ServerThread(create_app(engine, extra_routes=ROUTES, allowed_hosts=None),
                          engine).start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def decode_core(tiny_target):
    return LLM(tiny_target, num_blocks=64, block_size=8).engine


def wait_all_free(core, timeout_s: float = 5.0, holder=None) -> None:
    """Bounded wait until every block is back (and nothing is held), then the leak check."""
    blocks = core.block_manager
    deadline = time.monotonic() + timeout_s
    while blocks.num_free_blocks < blocks.num_blocks or (holder and holder.num_held):
        assert time.monotonic() < deadline, (
            f"{blocks.num_blocks - blocks.num_free_blocks} blocks still taken, "
            f"{holder.num_held if holder else 0} transfers held")
        time.sleep(0.02)
    blocks.check_no_leak()


class GatedTransport(TcpKVClient):
    """A transfer that takes its time: each pull waits for `gate`."""

    def __init__(self) -> None:
        super().__init__(timeout_s=10)
        self.gate = threading.Event()
        self.pulling = threading.Event()

    def pull(self, params):
        self.pulling.set()
        self.gate.wait(10)
        return super().pull(params)


def run_decode(server: ServerThread, core, body, transport=None):
    async def go():
        engine = DecodeEngine(core, PrefillClient([server.http], timeout_s=30), transport)
        await engine.start()
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(asyncio.wait_for(go(), 60))


def test_abort_while_the_prefill_server_computes(prefill_server, decode_core):
    prefill = prefill_server.engine
    # The prefill engine's thread is busy for a second: the prompt waits there.
    prefill.call_on_engine(lambda core: (time.sleep(1.0), [])[1])

    async def body(engine):
        stream = engine.add_request(PROMPT, LONG)
        while prefill.num_in_flight() == 0:  # the prefill request has reached the server
            await asyncio.sleep(0.01)
        stream.abort()
        return [d async for d in stream]

    deltas = run_decode(prefill_server, decode_core, body)
    assert [d.finish_reason for d in deltas] == ["abort"]
    # The decode server closed its request: the route cancelled the prefill (without the
    # disconnect watch it would run, and its blocks would wait 60 s for a pull).
    deadline = time.monotonic() + 10
    while prefill.num_in_flight():  # ended once the engine thread is free again
        assert time.monotonic() < deadline, "the prefill request never ended"
        time.sleep(0.02)
    wait_all_free(prefill_server.core, holder=prefill.handoff)
    wait_all_free(decode_core)


def test_abort_mid_transfer_releases_the_prefill_side(prefill_server, decode_core):
    prefill = prefill_server.engine
    transport = GatedTransport()

    async def body(engine):
        stream = engine.add_request(PROMPT, LONG)
        await asyncio.to_thread(transport.pulling.wait, 10)
        assert prefill.handoff.num_held == 1  # prefilled, waiting for the pull
        stream.abort()
        deltas = [d async for d in stream]
        # The pull is still "on the wire" (gated), and the prefill side has freed already.
        await asyncio.to_thread(wait_all_free, prefill_server.core, 5.0, prefill.handoff)
        transport.gate.set()
        return deltas

    deltas = run_decode(prefill_server, decode_core, body, transport)
    assert [d.finish_reason for d in deltas] == ["abort"]
    wait_all_free(decode_core)


def test_abort_mid_decode_frees_both_sides(prefill_server, decode_core):
    async def body(engine):
        stream = engine.add_request(PROMPT, LONG)
        seen, deltas = 0, []
        async for delta in stream:
            deltas.append(delta)
            seen += len(delta.token_ids)
            if seen >= 3 and not stream.finished:
                stream.abort()
        return deltas

    deltas = run_decode(prefill_server, decode_core, body)
    assert deltas[-1].finish_reason == "abort"
    assert deltas[-1].metrics["kv_transfer_ms"] > 0  # it did decode from transferred KV
    wait_all_free(decode_core)
    wait_all_free(prefill_server.core, holder=prefill_server.engine.handoff)


@pytest.mark.parametrize("delay_s", [0.0, 0.002, 0.01, 0.05])
def test_a_prefill_cancelled_at_any_moment_holds_nothing(tiny_target, delay_s):
    core = LLM(tiny_target, num_blocks=32, block_size=8).engine

    async def go():
        engine = PrefillEngine(core)
        await engine.start()
        try:
            task = asyncio.ensure_future(engine.prefill(PROMPT, {"temperature": 0.0}))
            await asyncio.sleep(delay_s)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            if not task.cancelled():  # it answered first: its blocks wait for a pull
                assert engine.handoff.num_held == 1
                engine.handoff.release(task.result()["request_id"])
            await asyncio.to_thread(wait_all_free, core, 5.0, engine.handoff)
            return task.cancelled()
        finally:
            await engine.shutdown()

    cancelled = asyncio.run(asyncio.wait_for(go(), 30))
    assert cancelled or delay_s > 0  # with no delay the cancel always lands mid-prefill
