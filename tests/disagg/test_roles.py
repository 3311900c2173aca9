"""The roles' faults without a second process: bad flag combinations, a decode server whose
prefill server is down or whose client gives up, held blocks nobody comes for, and a decode
server whose KV token does not match the prefill server's."""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from specserve import LLM, SamplingParams
from specserve.cli import main
from specserve.disagg.decode import DecodeEngine, PrefillClient
from specserve.disagg.handoff import PrefillHandoff

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.mark.parametrize(("flags", "message"), [
    (["--role", "decode"], "--role decode needs --prefill-url URL"),
    (["--prefill-url", "http://127.0.0.1:1"], "--prefill-url is for --role decode"),
    (["--role", "prefill", "--tp", "2"], "does not run with --tp or --replicas yet"),
    (["--prefill-replicas", "1"], "--prefill-replicas is for --replicas N"),
])
def test_bad_role_flags_fail_before_loading(flags, message, capsys):
    assert main(["serve", "--target", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def llm(tiny_target):
    return LLM(tiny_target, num_blocks=32, block_size=8)


def _decode_engine(llm: LLM) -> DecodeEngine:
    return DecodeEngine(llm.engine, PrefillClient([f"http://127.0.0.1:{_closed_port()}"],
                                                  timeout_s=5))


def test_prefill_server_down_is_a_clear_error_at_once(llm):
    async def run():
        engine = _decode_engine(llm)
        await engine.start()
        try:
            start = time.monotonic()
            deltas = [d async for d in engine.add_request([5, 6, 7], GREEDY)]
            return deltas, time.monotonic() - start
        finally:
            await engine.shutdown()

    deltas, elapsed = asyncio.run(asyncio.wait_for(run(), 60))
    assert [d.finish_reason for d in deltas] == ["error"]
    assert "prefill failed: no prefill server answered: http://127.0.0.1:" in deltas[0].error
    assert elapsed < 10
    llm.engine.block_manager.check_no_leak()


def test_colocated_requests_still_run_on_a_decode_server(llm):
    """Prompt log-probabilities need this engine's own forward over the prompt."""
    async def run():
        engine = _decode_engine(llm)
        await engine.start()
        try:
            params = SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0)
            return [d async for d in engine.add_request([5, 6, 7], params)]
        finally:
            await engine.shutdown()

    deltas = asyncio.run(asyncio.wait_for(run(), 60))
    assert deltas[-1].finish_reason == "length"
    assert sum(len(d.token_ids) for d in deltas) == 4


def test_abort_while_prefilling_remotely_ends_the_stream(llm):
    async def run():
        listener = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)  # never answers
        port = listener.sockets[0].getsockname()[1]
        engine = DecodeEngine(llm.engine, PrefillClient([f"http://127.0.0.1:{port}"]))
        await engine.start()
        try:
            stream = engine.add_request([5, 6, 7], GREEDY)
            await asyncio.sleep(0.3)
            stream.abort()
            return [d async for d in stream]
        finally:
            await engine.shutdown()
            listener.close()

    deltas = asyncio.run(asyncio.wait_for(run(), 60))
    assert [d.finish_reason for d in deltas] == ["abort"]
    llm.engine.block_manager.check_no_leak()


def test_blocks_nobody_pulls_are_freed_after_their_time(llm):
    core = llm.engine
    handoff = PrefillHandoff(core, run_on_engine=lambda fn: fn(core), ttl_s=0.2)
    try:
        for prompt in ([5, 6, 7] * 5, [9, 8]):
            req = core.make_request(prompt, SamplingParams(temperature=0.0, max_tokens=1))
            req.kv_hold = True
            core.add(req)
            while core.has_work:
                core.step()
            time.sleep(0.3)
        # The second hold found the first stale and freed it; the second waits its turn.
        assert handoff.num_held == 1
        time.sleep(0.3)
        handoff.expire()
        assert handoff.num_held == 0
        core.block_manager.check_no_leak()
    finally:
        core.scheduler.hold_kv = None


def test_prefill_route_answers_kv_transfer_params_and_refuses_bad_input(llm):
    from starlette.testclient import TestClient

    from specserve.disagg.prefill import PREFILL_PATH, ROUTES, PrefillEngine
    from specserve.disagg.protocol import KVTransferParams
    from specserve.disagg.transport import TcpKVClient
    from specserve.server import create_app

    engine = PrefillEngine(llm.engine)
    with TestClient(create_app(engine, extra_routes=ROUTES, allowed_hosts=None)) as client:
        bad = client.post(PREFILL_PATH, json={"prompt_token_ids": [5, 10**9]})
        assert bad.status_code == 400 and "bad prefill request" in bad.json()["error"]["message"]
        unknown = client.post(PREFILL_PATH, json={"prompt_token_ids": [5], "nope": 1})
        assert unknown.status_code == 400
        answer = client.post(PREFILL_PATH, json={"prompt_token_ids": [5, 6, 7] * 4,
                                                 "sampling": {"temperature": 0.0}}).json()
        params = KVTransferParams(**answer["kv_transfer_params"])
        assert params.remote_port == engine.kv_server.port and len(params.remote_block_ids) == 2
        payload = TcpKVClient().pull(params)
        assert payload.meta.first_token == answer["first_token"]
        assert payload.tensors["target_kv"].shape[2] == 2  # 12 tokens in blocks of 8
        deadline = time.monotonic() + 10
        while llm.engine.block_manager.num_free_blocks < llm.engine.block_manager.num_blocks:
            assert time.monotonic() < deadline, "pulled blocks were not freed"
            time.sleep(0.05)
    llm.engine.block_manager.check_no_leak()


def test_a_decode_server_with_the_wrong_kv_token_is_refused_clearly(tiny_target, llm):
    from specserve.disagg.prefill import ROUTES, PrefillEngine
    from specserve.disagg.transport import TcpKVClient
    from specserve.server import create_app
    from tests.server.server_helpers import ServerThread

    prefill = PrefillEngine(LLM(tiny_target, num_blocks=32, block_size=8).engine,
                            kv_token="s3cret")
    server = ServerThread(create_app(prefill, extra_routes=ROUTES, allowed_hosts=None),
                          prefill).start()

    async def run(token):
        engine = DecodeEngine(llm.engine, PrefillClient([server.http], timeout_s=30),
                              TcpKVClient(token=token))
        await engine.start()
        try:
            return [d async for d in engine.add_request([5, 6, 7] * 4, GREEDY)]
        finally:
            await engine.shutdown()

    try:
        wrong = asyncio.run(asyncio.wait_for(run("guess"), 60))
        assert [d.finish_reason for d in wrong] == ["error"]
        assert "refused the transfer: wrong or missing KV token" in wrong[0].error
        right = asyncio.run(asyncio.wait_for(run("s3cret"), 60))
        assert right[-1].finish_reason == "length"
        assert sum(len(d.token_ids) for d in right) == GREEDY.max_tokens
    finally:
        server.stop()
    llm.engine.block_manager.check_no_leak()
