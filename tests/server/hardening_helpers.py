"""Helpers for the hardening tests: a server with small limits, raw HTTP, and its baseline.

`Baseline` records what a server holds when idle (open file descriptors, tasks on its event
loop, engine requests, admission tickets, free KV blocks); `Baseline.wait_back` requires every
one of them back after a test, so a leak of any kind fails the test that caused it.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx
import orjson
from server_helpers import NUM_BLOCKS, SPEC, ServerThread

from specserve.engine.async_engine import AsyncEngine
from specserve.engine.core import EngineCore
from specserve.llm import build_engine_config
from specserve.server import ServerLimits, create_app

# Two requests run side by side and one more may wait: capacity 3, cheap to reach.
MAX_NUM_SEQS = 2
MAX_QUEUED = 1
REQUEST_BYTES = 256 * 1024
READ_TIMEOUT_S = 1.0
MAX_CONNECTIONS = 48


def start_hard_server(target: Path, num_blocks: int = NUM_BLOCKS, **limit_overrides
                      ) -> ServerThread:
    core = EngineCore(build_engine_config(target, target, SPEC, num_blocks=num_blocks,
                                          max_num_seqs=MAX_NUM_SEQS))
    engine = AsyncEngine(core)
    options = dict(max_requests_in_flight=8, max_message_bytes=REQUEST_BYTES,  # noqa: C408
                   max_request_bytes=REQUEST_BYTES, max_queued_requests=MAX_QUEUED,
                   max_connections=MAX_CONNECTIONS, request_read_timeout_s=READ_TIMEOUT_S)
    options.update(limit_overrides)
    app = create_app(engine, model_name="tiny", limits=ServerLimits.for_engine(engine, **options))
    return ServerThread(app, engine).start()


def num_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def num_loop_tasks(srv: ServerThread) -> int:
    async def count() -> int:
        return len(asyncio.all_tasks())

    # The engine keeps the loop it was started on; the count must run on that loop.
    return asyncio.run_coroutine_threadsafe(count(), srv.engine._loop).result(5)


@dataclass(frozen=True)
class Baseline:
    fds: int
    tasks: int
    in_flight: int
    admitted: int
    free_blocks: int

    @classmethod
    def of(cls, srv: ServerThread) -> Baseline:
        state = srv.app.state.server
        return cls(num_fds(), num_loop_tasks(srv), srv.engine.num_in_flight(),
                   state.admission.active, srv.core.block_manager.num_free_blocks)

    @classmethod
    def settled(cls, srv: ServerThread, timeout: float = 5.0) -> Baseline:
        """The idle state once the previous test's leftovers are gone: sockets that only the
        garbage collector closes, and connections the server is still closing. Taken while
        either is pending, the baseline counts a descriptor that then closes mid-test."""
        deadline = time.monotonic() + timeout
        gc.collect()
        last = cls.of(srv)
        while time.monotonic() < deadline:
            time.sleep(0.05)
            gc.collect()
            if (now := cls.of(srv)) == last:
                return now
            last = now
        return last

    def wait_back(self, srv: ServerThread, timeout: float = 15.0) -> None:
        """Every counter back where it was (connections the server closes take a moment).

        Descriptors must not outnumber the baseline's; fewer means something opened before the
        test closed during it, which is no leak."""
        deadline = time.monotonic() + timeout
        while not (now := Baseline.of(srv)).holds_no_more_than(self):
            if time.monotonic() > deadline:
                raise AssertionError(f"not back to baseline: {now} != {self}")
            time.sleep(0.05)
            gc.collect()
        srv.core.block_manager.check_no_leak()

    def holds_no_more_than(self, before: Baseline) -> bool:
        return self.fds <= before.fds and replace(self, fds=before.fds) == before


def raw_http(port: int, data: bytes, timeout: float = 10.0) -> tuple[int, dict, bytes]:
    """Send raw bytes; read one response to its end (or to the server's close)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as sock:
        sock.sendall(data)
        return read_response(sock)


def read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response head: {buf!r}")
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.strip().lower(): v.strip() for k, v in
               (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", -1))
    while length < 0 or len(body) < length:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            break
        if not chunk:
            break
        body += chunk
    return status, headers, body


def request_bytes(method: str, path: str, body: bytes = b"", host: str = "127.0.0.1",
                  headers: dict | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}", "Connection: close"]
    if body or method == "POST":
        lines += ["Content-Type: application/json", f"Content-Length: {len(body)}"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def post_json(port: int, path: str, obj, **kwargs) -> tuple[int, dict, bytes]:
    body = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    return raw_http(port, request_bytes("POST", path, body, **kwargs))


def sse_events(port: int, path: str, obj) -> tuple[int, list[str]]:
    """POST a streaming request; the `data:` payloads of its server-sent events."""
    with httpx.Client(timeout=60) as client:
        r = client.post(f"http://127.0.0.1:{port}{path}", json=obj)
    return r.status_code, [line[6:] for line in r.text.split("\n") if line.startswith("data: ")]


def error_of(body: bytes) -> dict:
    """The OpenAI error object of a reply (fails unless the body has that shape)."""
    error = orjson.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return error
