"""The hardening pieces on their own: Host names, the allow-list defaults, admission tickets."""

from __future__ import annotations

import asyncio

import pytest
from starlette.datastructures import Headers

from specserve.server.admission import Admission
from specserve.server.hosts import LOOPBACK_NAMES, HostGuard, default_allowed_hosts, host_name
from specserve.validation import RequestError


@pytest.mark.parametrize(("value", "name"), [
    ("Example.COM:8000", "example.com"), ("localhost", "localhost"), ("[::1]:8000", "::1"),
    ("127.0.0.1:80", "127.0.0.1"), ("evil.example.", "evil.example"),
])
def test_host_name(value, name):
    assert host_name(value) == name


def test_default_allowed_hosts():
    assert default_allowed_hosts("127.0.0.1") == frozenset(LOOPBACK_NAMES)
    assert default_allowed_hosts("localhost", ["chat.lan"]) == {*LOOPBACK_NAMES, "chat.lan"}
    assert default_allowed_hosts("192.168.1.5") == {*LOOPBACK_NAMES, "192.168.1.5"}
    assert default_allowed_hosts("0.0.0.0") is None  # any; the CLI says so at start-up
    assert default_allowed_hosts("0.0.0.0", ["chat.example"]) == {*LOOPBACK_NAMES,
                                                                  "chat.example"}
    assert default_allowed_hosts("127.0.0.1", ["*"]) is None


def test_host_guard():
    guard = HostGuard(LOOPBACK_NAMES)
    assert guard.ok(Headers({"host": "localhost:8000"}))
    assert not guard.ok(Headers({"host": "evil.example:8000"}))
    assert not guard.ok(Headers({}))  # no Host at all: not ours to answer
    assert HostGuard(None).ok(Headers({"host": "anything"}))


def test_admission_tickets():
    async def go():
        admission = Admission(2)
        a, b = admission.admit(), admission.admit()
        with pytest.raises(RequestError) as info:
            admission.admit()
        assert (info.value.code, info.value.http_status) == ("overloaded", 429)
        a.release()
        a.release()  # idempotent: a second release must not free someone else's place
        assert admission.active == 1
        c = admission.admit()
        aborted = []
        b.attach(lambda: aborted.append("b"))
        admission.start_draining()
        with pytest.raises(RequestError) as info:
            admission.admit()
        assert (info.value.code, info.value.http_status) == ("server_unavailable", 503)
        assert admission.abort_all() == 1 and aborted == ["b"]  # c has no stream yet
        c.attach(lambda: aborted.append("c"))  # its stream came after the abort: ended at once
        assert aborted == ["b", "c"]
        assert not await admission.wait_idle(0.01)
        b.release()
        c.release()
        assert await admission.wait_idle(1)
        assert admission.num_refused == 2

    asyncio.run(go())



class _Connection:
    """A WebSocket connection as uvicorn's shutdown sees it. `closing`: the client's close
    frame came first, so sending ours raises as websockets does. Closing the transport ends
    the connection (uvicorn's connection_lost)."""

    def __init__(self, connections: set, closing: bool) -> None:
        self.connections, self.closing = connections, closing
        self.transport = self  # close() below is the transport's
        self.closed = False
        connections.add(self)

    def close(self) -> None:
        self.closed = True
        self.connections.discard(self)

    def shutdown(self) -> None:
        from websockets.exceptions import InvalidState

        if self.closing:
            raise InvalidState("connection is closing")
        self.close()


def test_shutdown_survives_a_websocket_already_in_its_closing_handshake():
    import uvicorn
    from uvicorn.lifespan.off import LifespanOff

    from specserve.server.drain import DrainingServer

    config = uvicorn.Config(app=None, lifespan="off", timeout_graceful_shutdown=1)
    server = DrainingServer(config, Admission(2), drain_timeout=0)
    server.servers, server.lifespan = [], LifespanOff(config)
    connections = server.server_state.connections
    closing, open_one = _Connection(connections, True), _Connection(connections, False)
    asyncio.run(server.shutdown())  # raised InvalidState before
    assert closing.closed and open_one.closed and not connections
