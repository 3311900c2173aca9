"""The Python SDK (`specserve.client`), async and sync, against the real server."""

from __future__ import annotations

import asyncio

import pytest
from server_helpers import run

from specserve import SamplingParams
from specserve.client import AsyncClient, Client, RequestFailedError, SpecserveError

pytestmark = pytest.mark.timeout(120)

PROMPT = "def add(a, b):"


def _expected(reference, prompt: str, n: int) -> str:
    return reference.generate(prompt, SamplingParams(temperature=0, max_tokens=n,
                                                     ignore_eos=True))[0].text


def test_async_chat_streams_text_and_reports_usage(server, reference):
    messages = [{"role": "user", "content": "hi"}]

    async def go():
        async with AsyncClient(server.http) as client:
            stream = client.chat(messages, temperature=0, max_output_tokens=10,
                                 ignore_eos=True)
            pieces = [piece async for piece in stream]
            return client.session, stream, pieces

    session, stream, pieces = run(go())
    assert session["model"] == "tiny"
    assert all(pieces) and "".join(pieces) == stream.text
    tok = reference.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    assert stream.text == reference.generate([ids], SamplingParams(
        temperature=0, max_tokens=10, ignore_eos=True))[0].text
    assert (stream.status, stream.reason) == ("incomplete", "max_output_tokens")
    assert stream.usage["output_tokens"] == 10 == sum(s["n_tokens"] for s in stream.steps)
    assert stream.metrics["acceptance_length"] > 1.0


def test_async_concurrent_chats_on_one_socket(server, reference):
    prompts = [PROMPT, "The quick brown fox", "héllo wörld"]

    async def go():
        async with AsyncClient(server.ws) as client:
            streams = [client.complete(p, temperature=0, max_output_tokens=30,
                                       ignore_eos=True) for p in prompts]
            results = await asyncio.gather(*(s.result() for s in streams))
            return results, client

    results, client = run(go())
    assert [r.text for r in results] == [_expected(reference, p, 30) for p in prompts]
    assert len({r.request_id for r in results}) == 3
    assert client._streams == {}


def test_async_cancel(server):
    async def go():
        async with AsyncClient(server.ws) as client:
            stream = client.complete(PROMPT, max_output_tokens=400, ignore_eos=True)
            async for _ in stream:
                await stream.cancel()
            rtt = await client.ping()
            return stream, rtt

    stream, rtt = run(go())
    assert (stream.status, stream.reason) == ("cancelled", "client_cancelled")
    assert stream.usage["output_tokens"] < 400
    assert 0 < rtt < 5


def test_async_errors_raise_with_code_and_param(server):
    async def go():
        async with AsyncClient(server.ws) as client:
            with pytest.raises(SpecserveError) as info:
                await client.complete(PROMPT, top_p=3.0).result()
            with pytest.raises(SpecserveError) as bad_default:
                await client.update_session(speculation="warp")
            # The socket is still good after both.
            ok = await client.complete(PROMPT, max_output_tokens=2).result()
            return info.value, bad_default.value, ok

    err, bad_default, ok = run(go())
    assert (err.code, err.param) == ("invalid_field", "response.top_p")
    assert bad_default.param == "session.defaults.speculation"
    assert ok.usage["output_tokens"] == 2


def test_failed_request_raises(server):
    runner = server.core.runner

    def broken(*args, **kwargs):
        raise RuntimeError("boom")

    async def go():
        async with AsyncClient(server.ws) as client:
            runner.forward = broken
            try:
                with pytest.raises(RequestFailedError) as info:
                    await client.complete(PROMPT, max_output_tokens=3).result()
            finally:
                del runner.forward
            return info.value

    assert "boom" in run(go()).message


def test_sync_client(server, reference):
    with Client(server.http, timeout=30) as client:
        stream = client.complete(PROMPT, temperature=0, max_output_tokens=12, ignore_eos=True)
        text = "".join(stream)
        assert text == _expected(reference, PROMPT, 12) == stream.text
        assert stream.usage["output_tokens"] == 12
        long = client.complete(PROMPT, max_output_tokens=400, ignore_eos=True)
        next(iter(long))
        long.cancel()
        result = long.result()
        assert result.status == "cancelled" and result.usage["output_tokens"] < 400
        assert client.update_session(temperature=0)["defaults"] == {"temperature": 0.0}
        assert client.ping() > 0
