"""A server in a thread of the benchmark's own process, on a free loopback port, so a bench
script can read the engine's state directly while its clients load the server."""

from __future__ import annotations

import socket
import threading
import time

import uvicorn

from specserve.server import uvicorn_config


def serve_in_thread(app) -> tuple[uvicorn.Server, threading.Thread, int]:
    """Start `app` on 127.0.0.1 at a free port; returns once it accepts connections.

    Stop it with `server.should_exit = True` and `thread.join()`."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn_config(app, "127.0.0.1", port, "warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, port
