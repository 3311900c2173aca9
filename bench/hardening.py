"""Attack a real `specserve serve` process with bad input and abusive clients; print a table.

    python -m bench hardening                 # tiny random model (the default)
    python -m bench hardening --target DIR --draft DIR

Each row: what was tried, how many times, what the server answered, what was lost afterwards
(KV blocks not back, file descriptors or requests left over, once the server is idle again),
`/health` latency while the attack ran (probed every 50 ms from a thread of its own), and the
server's RSS. The last row sends SIGTERM with streams in flight and reports their final events
and the exit code. The server runs in its own process, so the probe measures what any other
client would see.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import http.client
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import orjson

CHAT = "/v1/chat/completions"


class Served:
    def __init__(self, target: str, draft: str | None, max_queued: int, log: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        cmd = [sys.executable, "-m", "specserve", "serve", "--target", str(target),
               "--port", str(self.port), "--drain-timeout", "2", "--log-level", "warning",
               "--max-queued-requests", str(max_queued)]
        if draft:
            cmd += ["--draft", str(draft), "--speculation", "chain:3"]
        self.log = log.open("wb")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        while True:
            try:
                if self.get("/health")[0] == 200:
                    break
            except OSError:
                time.sleep(0.3)
            if self.proc.poll() is not None:
                raise RuntimeError(log.read_text())
        self.model = orjson.loads(self.get("/v1/models")[1])["data"][0]["id"]

    def get(self, path: str, timeout: float = 30) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        try:
            conn.request("GET", path)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def counters(self) -> dict:
        metrics = self.get("/metrics")[1].decode()
        values = {line.split("{")[0]: float(line.rsplit(" ", 1)[1])
                  for line in metrics.splitlines() if line.startswith("specserve_kv_blocks")}
        health = orjson.loads(self.get("/health")[1])
        with open(f"/proc/{self.proc.pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return {"free_blocks": values["specserve_kv_blocks_free"],
                "blocks": values["specserve_kv_blocks_total"],
                "in_flight": health["requests_in_flight"],
                "fds": len(os.listdir(f"/proc/{self.proc.pid}/fd")), "rss_mb": rss / 1024}

    def idle(self, timeout: float = 60) -> dict:
        deadline = time.monotonic() + timeout
        while True:
            c = self.counters()
            if (c["in_flight"] == 0 and c["free_blocks"] == c["blocks"]) or \
                    time.monotonic() > deadline:
                return c
            time.sleep(0.2)


class HealthProbe(threading.Thread):
    def __init__(self, port: int) -> None:
        super().__init__(daemon=True)
        self.port, self.samples, self.stop = port, [], threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.perf_counter()
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
                conn.request("GET", "/health")
                ok = conn.getresponse().status == 200
                conn.close()
            except OSError:
                ok = False
            self.samples.append(((time.perf_counter() - t0) * 1e3, ok))
            self.stop.wait(0.05)


# ---- raw clients --------------------------------------------------------------------------
def raw(port: int, data: bytes, timeout: float = 60) -> str:
    """Send bytes, return the status code (or what went wrong) and never the body."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        try:
            sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early and closed; its answer may still be readable
        try:
            head = sock.recv(64)
        except ConnectionResetError:
            return "reset"
    return head.split(b" ", 2)[1].decode() if head.startswith(b"HTTP/") else "closed"


def post(port: int, body: bytes, host: str = "127.0.0.1", declared: int | None = None) -> bytes:
    length = len(body) if declared is None else declared
    return (f"POST {CHAT} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\nConnection: close\r\n\r\n").encode() + body


def upgrade(port: int, host: str) -> bytes:
    return (f"GET /v1/ws HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\n"
            "Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
            f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Protocol: specserve.v1\r\n"
            f"Origin: http://{host}\r\n\r\n").encode()


async def ws_session(port: int, frames: list[dict | str], until_done: int,
                     abort_after_delta: bool = False) -> list[str]:
    """Send frames; return the outcome of each request (`done:STATUS` or `error:CODE`)."""
    from websockets.asyncio.client import connect

    async with connect(f"ws://127.0.0.1:{port}/v1/ws", subprotocols=["specserve.v1"],
                       compression=None, proxy=None, open_timeout=60, max_size=None) as ws:
        await ws.recv()
        for frame in frames:
            await ws.send(frame if isinstance(frame, str) else orjson.dumps(frame).decode())
        outcomes = []
        while len(outcomes) < until_done:
            event = orjson.loads(await asyncio.wait_for(ws.recv(), 300))
            if event["type"] == "error":
                outcomes.append(f"error:{event['code']}")
            elif event["type"] == "response.done":
                outcomes.append(f"done:{event['status']}/{event['reason']}")
            elif abort_after_delta and event["type"] == "response.output_text.delta":
                ws.transport.abort()
                return ["dropped"]
        return outcomes


def create(rid: str, model_tokens: int, **response) -> dict:
    return {"type": "response.create", "request_id": rid,
            "response": {"prompt": "def add(a, b):", "max_output_tokens": model_tokens,
                         **response}}


# ---- the attacks --------------------------------------------------------------------------
def attacks(srv: Served):
    port, model = srv.port, srv.model

    def chat(**fields) -> bytes:
        return orjson.dumps({"model": model, "max_tokens": 4,
                             "messages": [{"role": "user", "content": "hi"}], **fields})

    def repeat(n, fn):
        return collections.Counter(fn() for _ in range(n))

    def gather(coros):
        async def all_of():
            return await asyncio.gather(*coros, return_exceptions=True)
        results = asyncio.run(all_of())
        return collections.Counter(o if isinstance(r, list) else type(r).__name__
                                   for r in results for o in (r if isinstance(r, list) else [r]))

    big = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "a" * 10**7}]})
    mid = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "a" * 3 * 10**6}]})
    yield "10 MB chat message, HTTP", 10, lambda: repeat(10, lambda: raw(port, post(port, big)))
    yield "3 MB chat message (under the body cap), HTTP", 10, \
        lambda: repeat(10, lambda: raw(port, post(port, mid)))
    yield "900 KB WebSocket frame", 10, lambda: gather(
        [ws_session(port, [create("r", 4, prompt="a" * 900_000)], 1) for _ in range(10)])
    yield "64 MB declared body, 11 bytes sent", 20, \
        lambda: repeat(20, lambda: raw(port, post(port, b'{"model": "', declared=64 << 20)))
    yield "2048-node speculation tree, HTTP + WS", 20, lambda: repeat(
        10, lambda: raw(port, post(port, chat(speculation=[[i] for i in range(2048)])))) + gather(
        [ws_session(port, [create("t", 4, speculation=[[i] for i in range(2048)])], 1)
         for _ in range(10)])
    evil = f"evil.example:{port}"
    yield "Host evil.example (DNS rebinding), HTTP + WS", 40, lambda: repeat(
        20, lambda: raw(port, post(port, chat(), host=evil))) + repeat(
        20, lambda: raw(port, upgrade(port, evil)))
    yield 'content [{"type":"text","text":5}]', 20, lambda: repeat(20, lambda: raw(port, post(
        port, chat(messages=[{"role": "user", "content": [{"type": "text", "text": 5}]}]))))
    yield "stop with 5000 strings; role 'wizard'", 20, lambda: repeat(10, lambda: raw(
        port, post(port, chat(stop=["s"] * 5000)))) + repeat(10, lambda: raw(port, post(
            port, chat(messages=[{"role": "wizard", "content": "hi"}]))))
    yield "1024 requests over 64 WebSockets", 1024, lambda: gather(
        [ws_session(port, [create(f"r{i}", 16) for i in range(16)], 16) for _ in range(64)])

    def concurrent_http() -> collections.Counter:
        threads, results = [], collections.Counter()
        lock = threading.Lock()

        def one():
            status = raw(port, post(port, chat(max_tokens=16)), timeout=300)
            with lock:
                results[status] += 1

        for _ in range(100):
            threads.append(threading.Thread(target=one))
            threads[-1].start()
        for t in threads:
            t.join()
        return results

    yield "100 concurrent HTTP requests", 100, concurrent_http

    def slowloris() -> collections.Counter:
        socks = []
        for _ in range(500):
            s = socket.create_connection(("127.0.0.1", port), timeout=30)
            s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            socks.append(s)
        time.sleep(12)  # past the 10 s request-read deadline
        results = collections.Counter()
        for s in socks:
            s.settimeout(1)
            try:
                results["closed by server" if s.recv(1) == b"" else "open"] += 1
            except TimeoutError:
                results["still open"] += 1
            except ConnectionResetError:
                results["closed by server"] += 1
            s.close()
        return results

    yield "500 half-sent request heads", 500, slowloris
    # In waves of 50, under the admission limit, so that every one is a real disconnect.
    yield "200 abrupt disconnects mid-stream", 200, lambda: sum(
        (gather([ws_session(port, [create("d", 64, ignore_eos=True)], 1,
                            abort_after_delta=True) for _ in range(50)]) for _ in range(4)),
        collections.Counter())


def sigterm(srv: Served) -> tuple[collections.Counter, int]:
    async def go():
        tasks = [asyncio.create_task(ws_session(srv.port, [create("long", 400, ignore_eos=True)],
                                                1)) for _ in range(4)]
        await asyncio.sleep(1.5)
        srv.proc.send_signal(signal.SIGTERM)
        return await asyncio.gather(*tasks, return_exceptions=True)

    results = asyncio.run(go())
    code = srv.proc.wait(60)
    return collections.Counter(str(r[0]) if isinstance(r, list) else type(r).__name__
                               for r in results), code


def main(argv: list[str] | None = None, prog: str = "python -m bench hardening") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="target model folder (default: a tiny random model)")
    parser.add_argument("--draft")
    parser.add_argument("--max-queued", type=int, default=64,
                        help="the server's --max-queued-requests (default 64)")
    args = parser.parse_args(argv)
    cpu = sorted({f for f in open("/proc/cpuinfo").read().split() if f.startswith("avx")})
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = args.target, args.draft
        if target is None:
            from tests.tiny_models import save_model  # run from the repository root

            target = draft = save_model(Path(tmp) / "tiny", "llama", seed=0)
        srv = Served(target, draft, args.max_queued, Path(tmp) / "serve.log")
        try:
            raw(srv.port, post(srv.port, orjson.dumps({"model": srv.model, "max_tokens": 4,
                                                       "prompt": "warm up"})))
            base = srv.idle()
            print(f"CPU flags {' '.join(cpu)}; --max-queued-requests {args.max_queued}; "
                  f"baseline {base}")
            print("| attack | times | result | lost (blocks, fds, requests) | /health ms p50 / max "
                  "(failed) | RSS MB before -> after |")
            print("|---|---|---|---|---|---|")
            for name, times, attack in attacks(srv):
                before = srv.idle()
                probe = HealthProbe(srv.port)
                probe.start()
                results = attack()
                probe.stop.set()
                probe.join()
                after = srv.idle()
                lat = sorted(ms for ms, _ in probe.samples)
                failed = sum(not ok for _, ok in probe.samples)
                lost = (int(after["blocks"] - after["free_blocks"]), after["fds"] - base["fds"],
                        after["in_flight"])
                print(f"| {name} | {times} | "
                      f"{', '.join(f'{k} x{v}' for k, v in sorted(results.items()))} | {lost} | "
                      f"{lat[len(lat) // 2]:.0f} / {lat[-1]:.0f} ({failed}) | "
                      f"{before['rss_mb']:.0f} -> {after['rss_mb']:.0f} |", flush=True)
            finals, code = sigterm(srv)
            print(f"| SIGTERM with 4 streams in flight (drain 2 s) | 1 | "
                  f"{', '.join(f'{k} x{v}' for k, v in finals.items())}; exit code {code} | - | "
                  f"- | - |")
        finally:
            if srv.proc.poll() is None:
                srv.proc.kill()
            srv.log.close()
    return 0
