"""`specserve serve --replicas 1` as a real process with its own local Ray cluster: the
gateway answers on --port from that process (Serve's HTTP proxy is not started), a stream in
flight at SIGTERM finishes within the drain timeout, new connections are refused meanwhile,
the process exits 0, and every process of the Ray cluster it started is gone after."""

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
import pytest

from tests.cluster.conftest import SPEC, free_port
from tests.server.server_helpers import WSConn, done_of, run

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def _stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) of a live process from /proc, or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[1])


def descendants(pid: int) -> dict[int, str]:
    """Every process below `pid` (Ray's, for a driver that started a local cluster), with its
    command line."""
    parents = {int(d.name): stat[1] for d in Path("/proc").iterdir()
               if d.name.isdigit() and (stat := _stat(int(d.name))) is not None}
    found, frontier = {}, [pid]
    while frontier:
        parent = frontier.pop()
        for child in [c for c, pp in parents.items() if pp == parent]:
            try:
                cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:  # it ended meanwhile
                continue
            found[child] = cmdline.decode(errors="replace")
            frontier.append(child)
    return found


def still_running(pids) -> list[int]:
    """Those of `pids` alive and not zombies (an orphan's zombie may wait for its reaper)."""
    return [pid for pid in pids if (stat := _stat(pid)) is not None and stat[0] != "Z"]


def test_sigterm_drains_the_gateway_and_takes_the_local_cluster_down(tiny_target, tmp_path):
    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a cluster of its own
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "specserve", "serve", "--replicas", "1",
             "--target", str(tiny_target), "--draft", str(tiny_target), "--speculation", SPEC,
             "--port", str(port), "--drain-timeout", "60", "--log-level", "warning"],
            stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 200
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                body = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).json()
                if body.get("replicas_healthy") == 1:
                    break
            except (httpx.TransportError, ValueError):
                pass
            assert time.monotonic() < deadline, "the gateway did not start:\n" + log.read_text()
            time.sleep(0.3)
        started = descendants(proc.pid)  # Ray's processes
        assert any("raylet" in cmd for cmd in started.values()), started
        assert not [cmd for cmd in started.values() if "ProxyActor" in cmd]

        async def go():
            async with WSConn(f"ws://127.0.0.1:{port}/v1/ws") as conn:
                await conn.create("short", prompt="abc", max_output_tokens=24, ignore_eos=True)
                assert (await conn.recv())["type"] == "response.created"
                proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                try:  # the listener is closed: no new connections
                    socket.create_connection(("127.0.0.1", port), timeout=2).close()
                    refused = False
                except ConnectionRefusedError:
                    refused = True
                return refused, done_of((await conn.until_done("short", timeout=60))["short"])

        refused, done = run(go(), timeout=90)
        assert refused
        assert (done["status"], done["usage"]["output_tokens"]) == ("incomplete", 24)
        assert done["metrics"]["replica"].startswith("SERVE_REPLICA::specserve#engine#")
        assert proc.wait(90) == 0, log.read_text()
        deadline = time.monotonic() + 30
        while still_running(started) and time.monotonic() < deadline:
            time.sleep(0.3)
        assert not still_running(started), [started[p][:120] for p in still_running(started)]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
