"""Soak: mixed load with abrupt disconnects for N minutes; the server must end where it began.

    python -m bench soak --minutes 10                       # tiny random model (the default)
    python -m bench soak --minutes 10 --target DIR --draft DIR

The server (the app and uvicorn settings `specserve serve` uses) runs on a thread of this
process, so its own counters can be read directly. `--clients` workers each loop over a mix:
WebSocket requests (some cancelled mid-stream), streaming and plain HTTP completions, and bad
requests (invalid fields, oversized prompts); `--disconnect` of the requests (10% by default)
drop their TCP connection mid-stream without a close. Before and after (once the server is
idle again) it prints RSS, free KV blocks, open file descriptors, event-loop tasks, requests in
the engine and admission tickets, and the counts of each outcome; any difference in blocks,
fds, tasks or requests, or an unexpected outcome, is a failure (exit code 1). RSS is reported,
not judged: the allocator keeps freed pages, so it is compared across the run's second half.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import os
import random
import tempfile
import time
from pathlib import Path

import httpx
import orjson

_OK = ("completed", "refused", "cancelled", "dropped", "bad_request_refused")


def open_files() -> list[str]:
    """What each open file descriptor points at (sockets, pipes, files)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:  # closed meanwhile (the listing's own descriptor)
            pass
    return out


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


class SoakServer:
    def __init__(self, target, draft, speculation, max_queued: int) -> None:
        from bench.inprocess import serve_in_thread
        from specserve.engine.async_engine import AsyncEngine
        from specserve.engine.core import EngineCore
        from specserve.llm import build_engine_config
        from specserve.server import ServerLimits, create_app

        self.core = EngineCore(build_engine_config(target, draft, speculation))
        self.engine = AsyncEngine(self.core)
        limits = ServerLimits.for_engine(self.engine, max_queued_requests=max_queued)
        self.app = create_app(self.engine, model_name="soak", limits=limits)
        self.server, self.thread, self.port = serve_in_thread(self.app)

    def snapshot(self) -> dict:
        async def tasks() -> int:
            return len(asyncio.all_tasks())

        state = self.app.state.server
        return {"rss_mb": round(rss_mb(), 1),
                "free_blocks": self.core.block_manager.num_free_blocks,
                "fds": len(os.listdir("/proc/self/fd")), "files": open_files(),
                "loop_tasks": asyncio.run_coroutine_threadsafe(tasks(), self.engine._loop
                                                               ).result(10),
                "engine_requests": self.engine.num_in_flight(),
                "admitted": state.admission.active}

    def wait_idle(self, timeout: float = 60) -> dict:
        """A snapshot once nothing is in flight and the descriptor count has settled."""
        deadline = time.monotonic() + timeout
        last_fds = -1
        while True:
            snap = self.snapshot()
            if (snap["engine_requests"] == 0 and snap["admitted"] == 0
                    and snap["free_blocks"] == self.core.block_manager.num_blocks
                    and not self.server.server_state.connections and snap["fds"] == last_fds):
                return snap
            last_fds = snap["fds"]
            if time.monotonic() > deadline:
                return snap
            time.sleep(0.5)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


# ---- the clients --------------------------------------------------------------------------
PROMPTS = ["def add(a, b):", "Explain the os module.", "The quick brown fox",
           "Write a haiku about lists."]


async def ws_request(port: int, rng: random.Random, max_tokens: int, drop: bool,
                     cancel: bool) -> str:
    from websockets.asyncio.client import connect

    async with connect(f"ws://127.0.0.1:{port}/v1/ws", subprotocols=["specserve.v1"],
                       compression=None, proxy=None, open_timeout=30) as ws:
        await ws.recv()  # session.created
        await ws.send(orjson.dumps({"type": "response.create", "request_id": "r", "response": {
            "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_output_tokens": max_tokens, "ignore_eos": True}}).decode())
        deltas = 0
        while True:
            event = orjson.loads(await asyncio.wait_for(ws.recv(), 120))
            kind = event["type"]
            if kind == "error":
                return "refused" if event["code"] == "overloaded" else f"error:{event['code']}"
            if kind == "response.output_text.delta":
                deltas += 1
                if drop and deltas == 2:
                    ws.transport.abort()  # no close frame, no FIN handshake to wait for
                    return "dropped"
                if cancel and deltas == 2:
                    await ws.send(orjson.dumps({"type": "response.cancel",
                                                "request_id": "r"}).decode())
            if kind == "response.done":
                status = event["status"]
                return {"completed": "completed", "incomplete": "completed",
                        "cancelled": "cancelled"}.get(status, f"done:{status}")


async def http_request(client: httpx.AsyncClient, port: int, rng: random.Random,
                       max_tokens: int, drop: bool, stream: bool) -> str:
    body = {"model": "soak", "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    if not stream:
        r = await client.post(url, json=body)
        return ("completed" if r.status_code == 200 else
                "refused" if r.status_code == 429 else f"http:{r.status_code}")
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            return "refused" if r.status_code == 429 else f"http:{r.status_code}"
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunks += 1
                if drop and chunks == 2:
                    return "dropped"  # leaving the block closes the connection mid-stream
                if line == "data: [DONE]":
                    return "completed"
    return "http:no_done"


async def bad_request(client: httpx.AsyncClient, port: int, rng: random.Random) -> str:
    bodies = [{"model": "soak", "messages": [{"role": "user", "content": [{"type": "text",
                                                                           "text": 5}]}]},
              {"model": "soak", "messages": [{"role": "user", "content": "x" * 300_000}]},
              {"model": "soak", "messages": [{"role": "wizard", "content": "hi"}]},
              {"model": "soak", "messages": [], "stop": ["a"] * 50}]
    r = await client.post(f"http://127.0.0.1:{port}/v1/chat/completions",
                          json=rng.choice(bodies))
    # Admission comes before validation: at capacity a bad request is refused as overloaded.
    return ("bad_request_refused" if r.status_code == 400 else
            "refused" if r.status_code == 429 else f"http:{r.status_code}")


async def client_loop(port: int, seed: int, until: float, disconnect: float, max_tokens: int,
                      outcomes: collections.Counter) -> None:
    rng = random.Random(seed)
    # No kept-alive connections: a pooled one the server closes for idleness (after 5 s) while
    # a request goes out on it fails on the client side, which is not what this measures.
    no_reuse = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=120, limits=no_reuse) as client:
        while time.monotonic() < until:
            drop = rng.random() < disconnect
            kind = rng.random()
            try:
                if kind < 0.1:
                    outcome = await bad_request(client, port, rng)
                elif kind < 0.55:
                    outcome = await ws_request(port, rng, max_tokens, drop,
                                               cancel=rng.random() < 0.1)
                else:
                    outcome = await http_request(client, port, rng, max_tokens, drop,
                                                 stream=rng.random() < 0.7)
            except Exception as exc:  # a client-side failure is an outcome to count
                outcome = f"client:{type(exc).__name__}"
            outcomes[outcome] += 1


async def health_probe(port: int, until: float, latencies: list[float]) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        while time.monotonic() < until:
            t0 = time.perf_counter()
            await client.get(f"http://127.0.0.1:{port}/health")
            latencies.append((time.perf_counter() - t0) * 1e3)
            await asyncio.sleep(0.5)


async def load(port: int, args, outcomes, latencies, rss: list[tuple[float, float]]) -> None:
    until = time.monotonic() + args.minutes * 60
    start = time.monotonic()

    async def sample_rss() -> None:
        while time.monotonic() < until:
            rss.append((time.monotonic() - start, rss_mb()))
            await asyncio.sleep(5)

    await asyncio.gather(health_probe(port, until, latencies), sample_rss(),
                         *(client_loop(port, args.seed + i, until, args.disconnect,
                                       args.max_tokens, outcomes)
                           for i in range(args.clients)))


async def warm_up(port: int) -> None:
    async with httpx.AsyncClient(timeout=120) as client:
        await http_request(client, port, random.Random(0), 4, False, False)


def main(argv: list[str] | None = None, prog: str = "python -m bench soak") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="target model folder (default: a tiny random model)")
    parser.add_argument("--draft")
    parser.add_argument("--speculation", default="chain:3")
    parser.add_argument("--minutes", type=float, default=10)
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--disconnect", type=float, default=0.1,
                        help="fraction of requests dropped mid-stream (default 0.1)")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-queued", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        target, draft = args.target, args.draft
        if target is None:
            from tests.tiny_models import save_model  # run from the repository root

            target = draft = save_model(Path(tmp) / "tiny", "llama", seed=0)
        srv = SoakServer(target, draft, args.speculation, args.max_queued)
        try:
            # One warm-up request so lazily built state (kernels, caches) is in the baseline.
            asyncio.run(warm_up(srv.port))
            before = srv.wait_idle()
            outcomes: collections.Counter = collections.Counter()
            latencies: list[float] = []
            rss: list[tuple[float, float]] = []
            asyncio.run(load(srv.port, args, outcomes, latencies, rss))
            after = srv.wait_idle()
        finally:
            srv.stop()
    return report(args, before, after, outcomes, latencies, rss)


def report(args, before, after, outcomes, latencies, rss) -> int:
    cpu = sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith("avx")})
    print(f"soak: {args.minutes:g} min, {args.clients} clients, {args.disconnect:.0%} dropped "
          f"mid-stream, max_tokens {args.max_tokens}; CPU flags {' '.join(cpu)}")
    print(f"{'':16}{'before':>10}{'after':>10}")
    for key in before:
        if key != "files":
            print(f"{key:16}{before[key]:>10}{after[key]:>10}")
    kinds = collections.Counter(f.split(":")[0] for f in after["files"])
    kinds.subtract(f.split(":")[0] for f in before["files"])
    if any(kinds.values()):
        print(f"open files after - before, by kind: {dict(+kinds)} more, {dict(-kinds)} fewer")
    total = sum(outcomes.values())
    print(f"requests: {total}; " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
    if latencies:
        lat = sorted(latencies)
        print(f"/health ms: p50 {lat[len(lat) // 2]:.1f}, p99 {lat[int(len(lat) * 0.99)]:.1f}, "
              f"max {lat[-1]:.1f} ({len(lat)} probes)")
    if len(rss) >= 4:
        half = [mb for _, mb in rss[len(rss) // 2:]]
        print(f"RSS over the second half: {half[0]:.1f} -> {half[-1]:.1f} MB "
              f"(min {min(half):.1f}, max {max(half):.1f})")
    leaks = [k for k in ("free_blocks", "fds", "loop_tasks", "engine_requests", "admitted")
             if before[k] != after[k]]
    unexpected = {k: v for k, v in outcomes.items() if k not in _OK}
    if leaks or unexpected:
        print(f"FAIL: changed {leaks}; unexpected outcomes {unexpected}")
        return 1
    print("OK: blocks, fds, tasks and requests back at baseline; every outcome expected")
    return 0
