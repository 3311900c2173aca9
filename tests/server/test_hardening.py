"""What one client can send, on loopback: every attempt is refused or served, none stalls the
server, and each test ends with descriptors, tasks, requests and KV blocks back at baseline."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
import time

import orjson
import pytest
from hardening_helpers import (
    MAX_CONNECTIONS,
    MAX_NUM_SEQS,
    MAX_QUEUED,
    READ_TIMEOUT_S,
    REQUEST_BYTES,
    Baseline,
    error_of,
    post_json,
    raw_http,
    read_response,
    request_bytes,
    sse_events,
    start_hard_server,
)
from server_helpers import SPEC, WSConn, done_of, run, text_of

from specserve import LLM, SamplingParams
from specserve.validation import MAX_STOP_STRINGS, MAX_TREE_DEPTH, MAX_TREE_NODES

pytestmark = pytest.mark.timeout(180)

CHAT = "/v1/chat/completions"
USER = [{"role": "user", "content": "Say something."}]


@pytest.fixture(scope="module")
def hard(tiny_target):
    srv = start_hard_server(tiny_target)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def baseline(hard):
    before = Baseline.settled(hard)
    yield
    before.wait_back(hard)


def _chat(**fields) -> dict:
    return {"model": "tiny", "messages": USER, "max_tokens": 2, **fields}


# ---- 1. prompts too big to tokenize on the loop ----------------------------------------------
def test_oversized_prompt_is_refused_before_any_tokenizing(hard, monkeypatch):
    tok = hard.engine.tokenizer
    calls = []
    real_encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda *a, **k: calls.append(1) or real_encode(*a, **k))
    big = "a" * 200_000  # under the body cap, over the prompt's byte cap
    status, _, body = post_json(hard.port, CHAT, _chat(messages=[{"role": "user",
                                                                   "content": big}]))
    assert status == 400
    assert (error_of(body)["code"], error_of(body)["param"]) == ("prompt_too_long", "messages")
    status, _, body = post_json(hard.port, "/v1/completions", {"model": "tiny", "prompt": big})
    assert status == 400 and error_of(body)["code"] == "prompt_too_long"

    async def ws():
        async with WSConn(hard.ws) as conn:
            await conn.create("big", prompt=big)
            error = (await conn.until_done("big"))["big"][-1]
            await conn.roundtrip_ok()
            return error

    error = run(ws())
    assert (error["type"], error["code"]) == ("error", "prompt_too_long")
    assert calls == []


def test_tokenizing_runs_off_the_event_loop(hard, monkeypatch):
    """A tokenizer call that blocks must not block /health: it runs on the worker thread."""
    tok = hard.engine.tokenizer
    entered, release, threads = threading.Event(), threading.Event(), []
    real_encode = tok.encode

    def blocking_encode(*args, **kwargs):
        threads.append(threading.current_thread().name)
        entered.set()
        release.wait(20)
        return real_encode(*args, **kwargs)

    monkeypatch.setattr(tok, "encode", blocking_encode)
    result = {}
    worker = threading.Thread(target=lambda: result.update(
        reply=post_json(hard.port, CHAT, _chat())))
    worker.start()
    try:
        assert entered.wait(20)
        status, _, body = raw_http(hard.port, request_bytes("GET", "/health"), timeout=5)
        assert status == 200 and orjson.loads(body)["status"] == "ok"
    finally:
        release.set()
        worker.join(30)
    assert result["reply"][0] == 200
    assert threads and all(name.startswith("specserve-tokenize") for name in threads)


# ---- 2. HTTP bodies ------------------------------------------------------------------------
def test_declared_oversized_body_gets_413_before_it_is_read(hard):
    head = request_bytes("POST", CHAT).replace(b"Content-Length: 0",
                                               f"Content-Length: {64 << 20}".encode())
    with socket.create_connection(("127.0.0.1", hard.port), timeout=10) as sock:
        sock.sendall(head + b'{"model": "')  # 11 of the 64 MiB announced
        status, headers, body = read_response(sock)
        assert sock.recv(1) == b""  # and the connection is closed, the rest never read
    assert status == 413 and headers["connection"] == "close"
    assert error_of(body)["code"] == "request_too_large"


def test_chunked_oversized_body_gets_413(hard):
    head = (f"POST {CHAT} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            "Transfer-Encoding: chunked\r\n\r\n").encode()
    chunk = b"x" * 65536
    with socket.create_connection(("127.0.0.1", hard.port), timeout=10) as sock:
        sock.sendall(head)
        try:
            for _ in range(REQUEST_BYTES // len(chunk) + 2):
                sock.sendall(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed while chunks were still going out
        status, _, body = read_response(sock)
    assert status == 413 and error_of(body)["code"] == "request_too_large"


def test_errors_echo_no_more_than_a_short_quote(hard):
    name = "m" * 100_000
    status, _, body = post_json(hard.port, CHAT, {"model": name, "messages": USER})
    assert status == 404 and error_of(body)["code"] == "model_not_found"
    assert len(body) < 1000


# ---- 3. client-sent trees, stop lists, roles, content --------------------------------------
def _wide_tree(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]


@pytest.mark.parametrize(("speculation", "what"), [
    (_wide_tree(2048), "nodes"),
    ([[0] * (MAX_TREE_DEPTH + 1)], "depth"),
    (_wide_tree(MAX_TREE_NODES + 1), "nodes"),
])
def test_speculation_trees_are_capped_on_every_route(hard, speculation, what):
    status, _, body = post_json(hard.port, CHAT, _chat(speculation=speculation))
    assert status == 400
    error = error_of(body)
    assert error["code"] == "invalid_field" and error["param"].startswith("speculation"), what

    async def ws():
        async with WSConn(hard.ws) as conn:
            await conn.create("t", prompt="abc", max_output_tokens=2, speculation=speculation)
            return (await conn.until_done("t"))["t"][-1]

    error = run(ws())
    assert (error["type"], error["code"]) == ("error", "invalid_field")
    assert error["param"].startswith("response.speculation")


def test_a_tree_at_the_caps_runs(hard):
    tree = [[i] for i in range(8)] + [[i, j] for i in range(7) for j in range(8)]
    assert len(tree) == MAX_TREE_NODES
    status, _, body = post_json(hard.port, CHAT, _chat(speculation=tree))
    assert status == 200 and orjson.loads(body)["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize(("field", "param"), [
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     "messages[0].content[0].text"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
     "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ({"stop": ["s"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": ""}, "stop"),
    ({"max_tokens": 10**9}, "max_tokens"),
])
def test_client_mistakes_are_400_with_the_field_named(hard, field, param):
    status, _, body = post_json(hard.port, CHAT, _chat(**field))
    assert status == 400, body
    error = error_of(body)
    assert error["code"] == "invalid_field" and error["param"] == param, error


def test_websocket_stop_and_roles_have_the_same_caps(hard):
    async def ws():
        async with WSConn(hard.ws) as conn:
            await conn.create("s", prompt="abc", stop=["s"] * (MAX_STOP_STRINGS + 1))
            await conn.create("r", messages=[{"role": "wizard", "content": "hi"}])
            events = await conn.until_done("s", "r")
            return events["s"][-1], events["r"][-1]

    stop, role = run(ws())
    assert (stop["code"], stop["param"]) == ("invalid_field", "response.stop")
    assert (role["code"], role["param"]) == ("invalid_field", "response.messages[0].role")


def test_unknown_routes_and_methods_answer_in_the_error_shape(hard):
    status, _, body = raw_http(hard.port, request_bytes("GET", "/nope"))
    assert status == 404 and error_of(body)["code"] == "not_found"
    status, _, body = raw_http(hard.port, request_bytes("GET", CHAT))
    assert status == 405 and error_of(body)["code"] == "method_not_allowed"


# ---- 4. Host and Origin --------------------------------------------------------------------
def _upgrade(port: int, host: str, origin: str | None = None) -> int:
    headers = {"Upgrade": "websocket", "Connection": "Upgrade",
               "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==", "Sec-WebSocket-Version": "13",
               "Sec-WebSocket-Protocol": "specserve.v1"}
    if origin:
        headers["Origin"] = origin
    lines = ["GET /v1/ws HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
        return int(sock.recv(4096).split(b" ", 2)[1])


def test_a_foreign_host_is_refused_dns_rebinding(hard):
    evil = f"evil.example:{hard.port}"
    status, _, body = raw_http(hard.port, request_bytes(
        "GET", "/v1/models", host=evil, headers={"Origin": f"http://{evil}"}))
    assert status == 421 and error_of(body)["code"] == "host_not_allowed"
    status, _, _ = post_json(hard.port, CHAT, _chat(), host=evil)
    assert status == 421
    assert _upgrade(hard.port, evil, f"http://{evil}") == 403
    for name in ("127.0.0.1", "localhost", "[::1]"):
        assert raw_http(hard.port, request_bytes("GET", "/health",
                                                 host=f"{name}:{hard.port}"))[0] == 200
    assert _upgrade(hard.port, f"localhost:{hard.port}") == 101


def test_origin_must_match_the_scheme_too(hard):
    host = f"127.0.0.1:{hard.port}"
    status, _, body = raw_http(hard.port, request_bytes(
        "GET", "/v1/models", host=host, headers={"Origin": f"https://{host}"}))
    assert status == 403 and error_of(body)["code"] == "origin_not_allowed"
    assert _upgrade(hard.port, host, f"https://{host}") == 403
    assert raw_http(hard.port, request_bytes("GET", "/v1/models", host=host,
                                             headers={"Origin": f"http://{host}"}))[0] == 200
    assert _upgrade(hard.port, host, f"http://{host}") == 101


# ---- 6. admission control ------------------------------------------------------------------
def test_past_the_queue_limit_requests_are_refused_with_overloaded(hard):
    capacity = MAX_NUM_SEQS + MAX_QUEUED
    ids = [f"long{i}" for i in range(capacity)]

    async def go():
        async with WSConn(hard.ws) as conn:
            for rid in ids:
                await conn.create(rid, prompt="abc", max_output_tokens=400, ignore_eos=True)
            started = set()
            while started != set(ids):
                event = await conn.recv(30)
                assert event["type"] != "error", event
                if event["type"] == "response.created":
                    started.add(event["request_id"])
            await conn.create("one-more", prompt="abc", max_output_tokens=2)
            refused = (await conn.until_done("one-more"))["one-more"][-1]
            http = await asyncio.to_thread(post_json, hard.port, CHAT, _chat())
            for rid in ids:
                await conn.send({"type": "response.cancel", "request_id": rid})
            done = await conn.until_done(*ids, timeout=60)
            return refused, http, [done_of(done[rid])["status"] for rid in ids]

    refused, (status, headers, body), statuses = run(go(), timeout=120)
    assert (refused["type"], refused["code"]) == ("error", "overloaded")
    assert status == 429 and headers["retry-after"] == "1"
    assert error_of(body)["code"] == "overloaded"
    assert statuses == ["cancelled"] * capacity
    # And once they are gone, the server takes requests again.
    assert post_json(hard.port, CHAT, _chat())[0] == 200


# ---- 7. slowloris and the connection cap ---------------------------------------------------
def test_half_sent_requests_are_closed_and_cannot_starve_others(hard):
    partial = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
    socks = []
    try:
        for _ in range(2 * MAX_CONNECTIONS):
            sock = socket.create_connection(("127.0.0.1", hard.port), timeout=10)
            sock.sendall(partial)
            socks.append(sock)
        # The oldest waiting connections were closed to make room: a real request gets in.
        t0 = time.monotonic()
        assert raw_http(hard.port, request_bytes("GET", "/health"))[0] == 200
        health_s = time.monotonic() - t0
        # A trickling client does not extend its deadline.
        for _ in range(int(3 * READ_TIMEOUT_S / 0.2)):
            for sock in socks:
                try:
                    sock.send(b"a")
                except OSError:
                    pass
            time.sleep(0.2)
        for sock in socks:
            sock.settimeout(5)
            try:
                assert sock.recv(1) == b""
            except ConnectionResetError:
                pass
    finally:
        for sock in socks:
            sock.close()
    assert health_s < 5


# ---- 9. routine disconnects ----------------------------------------------------------------
class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_an_abrupt_disconnect_is_one_log_line(hard):
    handler = _Records()
    loggers = [logging.getLogger(name) for name in ("specserve", "uvicorn", "starlette")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)

    async def go():
        async with WSConn(hard.ws) as conn:
            for rid in ("a", "b"):
                await conn.create(rid, prompt="abc", max_output_tokens=300, ignore_eos=True)
            while (await conn.recv())["type"] != "response.output_text.delta":
                pass
            conn.ws.transport.abort()  # no close frame: the TCP connection just goes

    try:
        run(go())
        hard.wait_idle(30)
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)
    assert not [r for r in handler.records if r.exc_info or r.levelno >= logging.ERROR]
    assert len([r for r in handler.records if "client went away" in r.getMessage()]) == 1


# ---- faults --------------------------------------------------------------------------------
def _fail_next_step(monkeypatch, core) -> None:
    real_step = core.step
    armed = [True]

    def step():
        if armed[0]:
            armed[0] = False
            raise RuntimeError("injected fault")
        return real_step()

    monkeypatch.setattr(core, "step", step)


def test_a_failing_engine_step_fails_its_requests_and_the_server_goes_on(hard, monkeypatch):
    _fail_next_step(monkeypatch, hard.core)

    async def ws():
        async with WSConn(hard.ws) as conn:
            await conn.create("f", prompt="abc", max_output_tokens=4)
            failed = done_of((await conn.until_done("f"))["f"])
            await conn.create("ok", prompt="abc", max_output_tokens=4, ignore_eos=True)
            return failed, done_of((await conn.until_done("ok"))["ok"])

    failed, ok = run(ws())
    assert (failed["status"], failed["error"]["code"]) == ("failed", "engine_error")
    assert "injected fault" in failed["error"]["message"]
    assert ok["status"] == "incomplete" and ok["usage"]["output_tokens"] == 4

    _fail_next_step(monkeypatch, hard.core)
    status, _, body = post_json(hard.port, CHAT, _chat())
    assert status == 500 and error_of(body)["code"] == "engine_error"

    _fail_next_step(monkeypatch, hard.core)
    status, events = sse_events(hard.port, CHAT, _chat(stream=True))
    assert status == 200 and events[-1] == "[DONE]"
    assert orjson.loads(events[-2])["error"]["code"] == "engine_error"
    assert post_json(hard.port, CHAT, _chat())[0] == 200


PREEMPT_OUT = 70


def test_a_kv_pool_too_small_preempts_and_completes_everything(tiny_target):
    num_blocks = 8  # 128 token slots; two requests of ~90 tokens each do not fit together
    srv = start_hard_server(tiny_target, num_blocks=num_blocks, max_queued_requests=4)
    try:
        before = Baseline.settled(srv)
        prompts = ["def add(a, b):" * 5, "The quick brown fox" * 5, "hello world" * 6]

        async def go():
            async with WSConn(srv.ws) as conn:
                for i, p in enumerate(prompts):
                    await conn.create(f"p{i}", prompt=p, max_output_tokens=PREEMPT_OUT,
                                      ignore_eos=True, temperature=0)
                return await conn.until_done(*[f"p{i}" for i in range(len(prompts))],
                                             timeout=150)

        events = run(go(), timeout=160)
        before.wait_back(srv)
        assert srv.core.scheduler.num_preemptions > 0
    finally:
        srv.stop()
    reference = LLM(tiny_target, draft=tiny_target, speculation=SPEC, num_blocks=num_blocks,
                    max_num_seqs=MAX_NUM_SEQS)
    for i, p in enumerate(prompts):
        done = done_of(events[f"p{i}"])
        assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == PREEMPT_OUT
        expected = reference.generate(p, SamplingParams(temperature=0, max_tokens=PREEMPT_OUT,
                                                        ignore_eos=True))[0]
        assert text_of(events[f"p{i}"]) == expected.text
