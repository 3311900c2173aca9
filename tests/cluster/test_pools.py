"""Prefill and decode pools on Ray Serve: one prefill replica and one decode replica behind
the gateway (their own local cluster) stream the same greedy tokens as one engine, with the KV
moved between them under a KV token; /health reports both pools per replica; an abort
mid-decode frees the blocks on both sides; and nothing is left behind."""

from __future__ import annotations

import time

import httpx
import pytest

from specserve import SamplingParams
from specserve.cluster.app import PREFILL
from specserve.llm import LLM
from tests.cluster.conftest import NUM_BLOCKS, SPEC, ray, serve, serve_cluster
from tests.server.server_helpers import WSConn, done_of, run, text_of

pytestmark = pytest.mark.timeout(170)

PROMPTS = ["The quick brown fox", "def add(a, b): " * 6]


@pytest.fixture(scope="module")
def pools(tiny_target):
    yield from serve_cluster(tiny_target, num_replicas=1, prefill_replicas=1,
                             kv_token="s3cret")


def prefill_stats() -> dict:
    return serve.get_deployment_handle(PREFILL, "specserve").stats.remote().result()


def wait_idle(cluster, timeout_s: float = 15.0) -> None:
    """Every block back on the decode replica (its /health entry) and on the prefill replica,
    and no transfer held there."""
    deadline = time.monotonic() + timeout_s
    while True:
        replicas = httpx.get(f"{cluster.http}/health", timeout=10).json().get("replicas", [])
        decode_free = bool(replicas) and all(r["kv_blocks_free"] == r["kv_blocks_total"]
                                             and r["requests_in_flight"] == 0 for r in replicas)
        stats = prefill_stats()
        if decode_free and stats["num_free_blocks"] == stats["num_blocks"] \
                and stats["num_held"] == 0 and stats["num_in_flight"] == 0:
            return
        assert time.monotonic() < deadline, f"not idle: decode {replicas}, prefill {stats}"
        time.sleep(0.2)


def test_pools_stream_what_one_engine_streams(pools, tiny_target):
    reference = LLM(tiny_target, draft=tiny_target, speculation=SPEC, num_blocks=NUM_BLOCKS)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)

    async def go():
        async with WSConn(pools.ws) as conn:
            out = []
            for i, prompt in enumerate(PROMPTS):
                await conn.create(f"r{i}", prompt=prompt, temperature=0, max_output_tokens=16,
                                  ignore_eos=True)
                out.append((await conn.until_done(f"r{i}", timeout=60))[f"r{i}"])
            return out

    for prompt, events in zip(PROMPTS, run(go(), timeout=120)):
        assert text_of(events) == reference.generate(prompt, params)[0].text
        metrics = done_of(events)["metrics"]
        assert metrics["kv_transfer_ms"] > 0  # prefilled on the pool, pulled with the token
        assert metrics["replica"].startswith("SERVE_REPLICA::specserve#engine#")
    wait_idle(pools)


def test_health_reports_both_pools_per_replica(pools):
    deadline = time.monotonic() + 30
    while True:
        body = httpx.get(f"{pools.http}/health", timeout=10).json()
        if body.get("prefill_replicas_healthy") == 1 and body.get("replicas_healthy") == 1:
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.2)
    assert body["status"] == "ok" and body["prefill_replicas_expected"] == 1, body
    (prefill,) = body["prefill_replicas"]
    assert prefill["replica"].startswith("SERVE_REPLICA::specserve#prefill#")
    assert prefill["kv_blocks_total"] == NUM_BLOCKS and prefill["transfers_held"] == 0
    assert prefill["memory_bytes"] > 0 and prefill["report_age_s"] < 5
    (decode,) = body["replicas"]
    assert decode["replica"].startswith("SERVE_REPLICA::specserve#engine#")


def test_abort_mid_decode_frees_both_pools(pools):
    async def go():
        async with WSConn(pools.ws) as conn:
            await conn.create("long", prompt="count", temperature=0, max_output_tokens=400,
                              ignore_eos=True, speculation="off")
            assert (await conn.recv(30))["type"] == "response.created"
            assert (await conn.recv(30))["type"] == "response.output_text.delta"
            await conn.send({"type": "response.cancel", "request_id": "long"})
            return done_of((await conn.until_done("long", timeout=30))["long"])

    assert run(go(), timeout=60)["status"] == "cancelled"
    wait_idle(pools)


def test_nothing_is_left_behind(pools):
    def replica_actors() -> list[str]:
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                if a["name"].startswith("SERVE_REPLICA::specserve#")]

    assert len(replica_actors()) == 2  # the decode replica, the prefill replica
    serve.delete("specserve")
    deadline = time.monotonic() + 30
    while replica_actors():
        assert time.monotonic() < deadline, f"left behind: {replica_actors()}"
        time.sleep(0.2)
