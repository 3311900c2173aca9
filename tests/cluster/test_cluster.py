"""Two engine replicas on Ray Serve behind the gateway: the same greedy tokens as one engine over
WebSocket and SSE, prefix affinity and conversation stickiness (the replica named in the
response metrics), the vLLM gauges on /metrics, /health and /metrics per replica, admission
(429 / `overloaded`) over both replicas' slots, a replica killed mid-stream, and nothing left
behind (blocks, requests, Ray actors).

One cluster serves the whole module (conftest.py); the killed-replica test and the leak check
run last, in that order.
"""

from __future__ import annotations

import asyncio
import re
import time

import httpx
import orjson
import pytest

from specserve import SamplingParams
from specserve.llm import LLM
from tests.cluster.conftest import MAX_NUM_SEQS, MAX_QUEUED, NUM_BLOCKS, SPEC, ray, serve
from tests.server.server_helpers import WSConn, done_of, run, text_of

pytestmark = pytest.mark.timeout(170)

PROMPTS = ["The quick brown fox", "def add(a, b):"]
# 136 tokens (8 full KV blocks) of the tiny tokenizer, shared by every affinity request.
SHARED = "The quick brown fox jumps over the lazy dog. " * 8


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


@pytest.fixture(scope="module")
def reference(tiny_target) -> LLM:
    """One engine with the replicas' exact configuration."""
    return LLM(tiny_target, draft=tiny_target, speculation=SPEC, num_blocks=NUM_BLOCKS,
               max_num_seqs=MAX_NUM_SEQS)


def metrics_text(cluster) -> str:
    return httpx.get(f"{cluster.http}/metrics", timeout=10).text


def gauge(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


@pytest.fixture(autouse=True)
def _idle_after(request):
    """After each test: nothing in flight and every KV block free on every replica (the last
    test checks that itself, then deletes the application)."""
    yield
    if request.node.name == test_nothing_is_left_behind.__name__:
        return
    cluster = request.getfixturevalue("cluster")
    deadline = time.monotonic() + 15
    while True:
        text = metrics_text(cluster)
        busy = [gauge(text, n) for n in ("vllm:num_requests_running",
                                         "vllm:num_requests_waiting",
                                         "vllm:kv_cache_usage_perc")]
        if busy == [0, 0, 0]:
            return
        assert time.monotonic() < deadline, f"not idle: running, waiting, kv usage = {busy}"
        time.sleep(0.2)


async def _turn(conn: WSConn, rid: str, prompt: str, n: int, **extra) -> list[dict]:
    await conn.create(rid, prompt=prompt, temperature=0, max_output_tokens=n, ignore_eos=True,
                      **extra)
    return (await conn.until_done(rid, timeout=60))[rid]


def test_websocket_tokens_equal_one_engine(cluster, reference):
    async def one(prompt: str) -> list[dict]:
        async with WSConn(cluster.ws) as conn:
            return await _turn(conn, "r", prompt, 24, speculation_events=True)

    async def go():  # two sessions at once: the router spreads them by load
        return await asyncio.gather(*(one(p) for p in PROMPTS))

    for prompt, events in zip(PROMPTS, run(go(), timeout=90)):
        expected = reference.generate(prompt, _greedy(24))[0]
        steps = [e for e in events if e["type"] == "response.speculation.step"]
        assert [t for s in steps for t in s["token_ids"]] == expected.token_ids
        assert text_of(events) == expected.text
        done = done_of(events)
        assert done["status"] == "incomplete" and done["usage"]["output_tokens"] == 24
        assert done["metrics"]["replica"].startswith("SERVE_REPLICA::specserve#engine#")
        assert done["metrics"]["acceptance_length"] > 1  # speculation ran on the replica


def test_sse_chat_equals_one_engine(cluster, reference):
    messages = [{"role": "user", "content": "Say something."}]
    tok = reference.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True,
                                             tokenize=False), add_special_tokens=False)
    expected = reference.generate([ids], _greedy(20))[0]
    body = {"model": "tiny", "messages": messages, "max_tokens": 20, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{cluster.http}/v1/chat/completions", json=body,
                      timeout=60) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    chunks = [orjson.loads(line[6:]) for line in lines[:-1]]
    assert lines[-1] == "data: [DONE]"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == expected.text
    assert chunks[-1]["usage"]["completion_tokens"] == 20


def test_shared_prefix_lands_on_one_replica(cluster):
    """Requests from separate connections sharing a long prefix go where it is cached."""
    async def go():
        replicas, cached = [], []
        for i in range(4):
            async with WSConn(cluster.ws) as conn:  # a new session each time
                done = done_of(await _turn(conn, "p", f"{SHARED} Question {i}?", 4))
            replicas.append(done["metrics"]["replica"])
            cached.append(done["metrics"]["num_prefix_cached_tokens"])
        return replicas, cached

    replicas, cached = run(go(), timeout=90)
    assert len(set(replicas)) == 1, replicas
    assert all(n >= 4 * 16 for n in cached[1:]), cached  # the shared blocks were reused


def test_conversation_keeps_to_its_replica(cluster):
    """One socket's turns stay on one replica even when their prompts share nothing, while
    other sessions' turns spread by load."""
    async def go():
        async with WSConn(cluster.ws) as conn:
            return [done_of(await _turn(conn, f"t{i}", f"turn {i}: {'xyz' * i} {i * 7}", 3))
                    ["metrics"]["replica"] for i in range(4)]

    replicas = run(go(), timeout=90)
    assert len(set(replicas)) == 1, replicas


def _scrape_until(cluster, ready, timeout: float = 15.0) -> str:
    """Scrape /metrics until `ready(text)`: the replicas report every 0.2 s, and the report
    reaches the gateway through Ray's controller."""
    deadline = time.monotonic() + timeout
    while True:
        text = metrics_text(cluster)
        if ready(text) or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def test_vllm_gauges_on_metrics(cluster):
    async def go():
        async with WSConn(cluster.ws) as conn:
            # One token a step, so it is still running while the reports come in.
            await conn.create("long", prompt="count", temperature=0, max_output_tokens=400,
                              ignore_eos=True, speculation="off")
            assert (await conn.recv())["type"] == "response.created"
            assert (await conn.recv())["type"] == "response.output_text.delta"  # running
            during = await asyncio.to_thread(
                _scrape_until, cluster, lambda t: gauge(t, "vllm:kv_cache_usage_perc") > 0)
            await conn.send({"type": "response.cancel", "request_id": "long"})
            done = done_of((await conn.until_done("long"))["long"])
            return during, done

    during, done = run(go(), timeout=60)
    # It ran to its end or to the cancel: on a fast CPU the tiny model's 400 tokens can be done
    # between the scrape and the cancel. That it was running when scraped is the gauge's to say.
    assert done["status"] in ("cancelled", "incomplete"), done
    assert gauge(during, "vllm:num_requests_running") == 1
    assert gauge(during, "vllm:num_requests_waiting") == 0
    # 2 replicas x 64 blocks; the request holds at least one.
    assert 1 / 128 <= gauge(during, "vllm:kv_cache_usage_perc") <= 0.5
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting",
                 "vllm:kv_cache_usage_perc"):
        assert f"# TYPE {name} gauge" in during


def health(cluster) -> tuple[int, dict]:
    response = httpx.get(f"{cluster.http}/health", timeout=10)
    return response.status_code, response.json()


def _health_until(cluster, ready, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        code, body = health(cluster)
        if ready(body) or time.monotonic() > deadline:
            return body
        time.sleep(0.2)


def test_health_and_metrics_report_each_replica(cluster):
    body = _health_until(cluster, lambda b: b.get("replicas_healthy") == 2)
    assert body["status"] == "ok" and body["replicas_expected"] == 2, body
    replicas = body["replicas"]
    assert len({r["replica"] for r in replicas}) == 2
    for r in replicas:
        assert r["replica"].startswith("SERVE_REPLICA::specserve#engine#")
        assert r["status"] == "ok" and r["kv_blocks_total"] == NUM_BLOCKS
        assert r["memory_bytes"] > 50 << 20  # a process with torch and a model loaded
    text = metrics_text(cluster)
    for r in replicas:
        label = f'model_name="tiny",replica="{r["replica"]}"'
        assert f"specserve_replica_up{{{label}}} 1.0" in text
        assert re.search(rf"^specserve_replica_memory_bytes\{{{re.escape(label)}\}} \d", text,
                         re.M)


def test_admission_holds_across_replicas(cluster):
    """The gateway admits both replicas' batch slots plus its queue (2 x 2 + 1), spread over
    both replicas; one more is refused at once on either API, and the admitted ones finish."""
    capacity = 2 * MAX_NUM_SEQS + MAX_QUEUED
    n = 300  # long enough to be in flight while the extra requests are refused

    async def go():
        conns = [await WSConn(cluster.ws).__aenter__() for _ in range(capacity + 1)]
        try:
            for i, conn in enumerate(conns[:capacity]):  # a session each: spread by load
                await conn.create(f"long{i}", prompt=f"story {i}", temperature=0,
                                  max_output_tokens=n, ignore_eos=True, speculation="off")
                assert (await conn.recv(30))["type"] == "response.created"
            extra = conns[capacity]
            await extra.create("extra", prompt="one more", max_output_tokens=4)
            refused_ws = await extra.recv()
            refused_http = await asyncio.to_thread(
                httpx.post, f"{cluster.http}/v1/chat/completions", timeout=10,
                json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                      "max_tokens": 4})
            dones = [done_of((await conn.until_done(f"long{i}", timeout=120))[f"long{i}"])
                     for i, conn in enumerate(conns[:capacity])]
            return refused_ws, refused_http, dones
        finally:
            for conn in conns:
                await conn.__aexit__()

    refused_ws, refused_http, dones = run(go(), timeout=150)
    assert refused_ws["type"] == "error" and refused_ws["code"] == "overloaded", refused_ws
    assert refused_http.status_code == 429 and refused_http.headers["retry-after"] == "1"
    assert refused_http.json()["error"]["code"] == "overloaded"
    assert all(d["usage"]["output_tokens"] == n for d in dones)
    assert len({d["metrics"]["replica"] for d in dones}) == 2  # admitted over both replicas


@pytest.mark.slow
def test_killed_replica_ends_its_stream_and_the_next_request_succeeds(cluster):
    async def go():
        async with WSConn(cluster.ws) as conn:
            first = done_of(await _turn(conn, "warm", "hello", 2))["metrics"]["replica"]
            await conn.create("long", prompt="count", temperature=0, max_output_tokens=400,
                              ignore_eos=True, speculation="off")
            assert (await conn.recv())["type"] == "response.created"
            assert (await conn.recv())["type"] == "response.output_text.delta"
            # The conversation keeps to its replica: kill the one serving "long".
            ray.kill(ray.get_actor(first, namespace="serve"), no_restart=False)
            events = (await conn.until_done("long", timeout=30))["long"]
            done = done_of(events)
            after = done_of(await _turn(conn, "after", "hello again", 4))
            return done, after

    t0 = time.monotonic()
    done, after = run(go(), timeout=90)
    assert done["status"] == "failed" and done["error"]["code"] == "engine_error"
    assert "replica" in done["error"]["message"]
    assert time.monotonic() - t0 < 60
    assert after["status"] == "incomplete" and after["usage"]["output_tokens"] == 4


def test_nothing_is_left_behind(cluster):
    """Last: Ray has replaced the killed replica; every replica's blocks are free and no
    request is in flight anywhere; deleting the application leaves no Serve replica actor."""
    body = _health_until(cluster, lambda b: b.get("replicas_healthy") == 2
                         and all(r["requests_in_flight"] == 0
                                 and r["kv_blocks_free"] == r["kv_blocks_total"]
                                 for r in b["replicas"]))
    assert body["status"] == "ok" and body["requests_in_flight"] == 0, body
    assert all(r["requests_in_flight"] == 0 and r["kv_blocks_free"] == NUM_BLOCKS
               for r in body["replicas"]), body

    def replica_actors() -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::specserve#")]

    assert len(replica_actors()) == 2  # the two engine replicas (the gateway is no actor)
    serve.delete("specserve")
    deadline = time.monotonic() + 30
    while replica_actors():
        assert time.monotonic() < deadline, f"left behind: {replica_actors()}"
        time.sleep(0.2)
