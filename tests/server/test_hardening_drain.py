"""SIGTERM on a real `specserve serve` process: stop accepting, drain, final events, exit 0."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import orjson
import pytest
from server_helpers import WSConn, done_of, run

# Each test starts a `specserve serve` process (tens of seconds on a loaded machine). The
# drain is 0 s where streams must be ended and 60 s where they must finish, so neither outcome
# depends on how fast this machine generates.
pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]

LONG = 480  # output tokens: far more than a drain of 0 s lets run


class ServeProcess:
    def __init__(self, target: Path, drain_timeout: float, log: Path) -> None:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        self.log = log.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "specserve", "serve", "--target", str(target), "--draft",
             str(target), "--speculation", "chain:3", "--port", str(self.port),
             "--drain-timeout", str(drain_timeout), "--log-level", "info"],
            stdout=self.log, stderr=subprocess.STDOUT)
        self.http = f"http://127.0.0.1:{self.port}"
        self.ws = f"ws://127.0.0.1:{self.port}/v1/ws"
        deadline = time.monotonic() + 90
        while True:
            assert self.proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{self.http}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        os.kill(self.proc.pid, sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self.log.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self.log.close()


@pytest.fixture
def serve(tiny_target, tmp_path):
    procs = []

    def start(drain_timeout: float) -> ServeProcess:
        procs.append(ServeProcess(tiny_target, drain_timeout, tmp_path / f"serve{len(procs)}.log"))
        return procs[-1]

    yield start
    for p in procs:
        p.kill()


async def _sse(client: httpx.AsyncClient, url: str, model: str, lines: list[str],
               first: asyncio.Event) -> None:
    """A long streaming completion; its `data:` payloads go to lines."""
    body = {"model": model, "prompt": "abc", "max_tokens": LONG, "stream": True,
            "ignore_eos": True}
    async with client.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                lines.append(line[6:])
                first.set()


def test_sigterm_ends_every_stream_with_its_final_event_and_exits_0(serve):
    srv = serve(drain_timeout=0)

    async def go():
        sse_lines: list[str] = []
        first = asyncio.Event()
        async with httpx.AsyncClient(timeout=60) as client, WSConn(srv.ws) as conn:
            model = (await client.get(f"{srv.http}/v1/models")).json()["data"][0]["id"]
            sse = asyncio.create_task(_sse(client, f"{srv.http}/v1/completions", model,
                                           sse_lines, first))
            await conn.create("long", prompt="abc", max_output_tokens=LONG, ignore_eos=True)
            while (await conn.recv())["type"] != "response.output_text.delta":
                pass
            await asyncio.wait_for(first.wait(), 30)
            srv.signal()
            done = done_of((await conn.until_done("long", timeout=30))["long"])
            await asyncio.wait_for(sse, 30)
        return done, sse_lines

    done, sse_lines = run(go(), timeout=90)
    assert (done["status"], done["reason"]) == ("cancelled", "server_shutdown")
    assert sse_lines[-1] == "[DONE]"
    assert orjson.loads(sse_lines[-2])["error"]["code"] == "server_shutdown"
    assert srv.wait(30) == 0


def test_sigterm_lets_streams_finish_within_the_drain_timeout(serve):
    srv = serve(drain_timeout=60)

    async def go():
        async with WSConn(srv.ws) as conn:
            await conn.create("short", prompt="abc", max_output_tokens=24, ignore_eos=True)
            assert (await conn.recv())["type"] == "response.created"
            srv.signal()
            await asyncio.sleep(0.3)
            refused = None
            try:  # the listener is closed: no new connections
                socket.create_connection(("127.0.0.1", srv.port), timeout=2).close()
            except ConnectionRefusedError:
                refused = True
            done = done_of((await conn.until_done("short", timeout=60))["short"])
            return refused, done

    refused, done = run(go(), timeout=90)
    assert refused
    assert (done["status"], done["usage"]["output_tokens"]) == ("incomplete", 24)
    assert srv.wait(30) == 0


def test_a_second_signal_exits_at_once(serve):
    srv = serve(drain_timeout=120)

    async def go():
        async with WSConn(srv.ws) as conn:
            for i in range(4):  # enough work that the drain is still waiting half a second on
                await conn.create(f"long{i}", prompt="abc", max_output_tokens=LONG,
                                  ignore_eos=True)
            while (await conn.recv())["type"] != "response.output_text.delta":
                pass
            srv.signal()
            await asyncio.sleep(0.5)
            assert srv.proc.poll() is None  # draining: the requests may run on for 120 s
            srv.signal()

    run(go(), timeout=60)
    assert srv.wait(15) == 0
