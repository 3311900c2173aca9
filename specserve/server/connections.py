"""uvicorn's h11 protocol with a request-read deadline and a global connection cap.

uvicorn closes a keep-alive connection that stays silent after a response, but a connection that
trickles a request head a byte at a time (slowloris), or opens and sends nothing, is held for
ever, one file descriptor each. Here every connection must deliver a whole request (head and
body) within `read_timeout` seconds of its first byte or of opening, else it is closed. And the
server holds at most `max_connections` connections (HTTP and WebSocket): when a new one would go
past that, the oldest connection still waiting for its request is closed to make room, so
half-open connections cannot starve real clients of descriptors; when none is waiting, the new
connection is closed instead.

WebSocket connections that went quiet are uvicorn's job (`ws_ping_interval`/`ws_ping_timeout`).
"""

from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("specserve.server")

# States in which the client has not finished sending the current request.
_READING = (h11.IDLE, h11.SEND_BODY)


def guarded_h11_protocol(read_timeout: float, max_connections: int) -> type[H11Protocol]:
    """An H11Protocol subclass bound to these limits (uvicorn's `http=` takes a class)."""
    waiting: dict[GuardedH11Protocol, None] = {}  # insertion order: oldest first

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                oldest = next(iter(waiting), None)
                if oldest is None:
                    log.warning("connection limit (%d) reached; closing a new connection",
                                max_connections)
                    transport.close()
                    return
                oldest._expire()
            self._await_request()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            upgraded = self.transport.get_protocol() is not self
            if upgraded or self.conn.their_state not in _READING:
                self._request_arrived()
            elif self._deadline is None:  # the first bytes of the next request on this socket
                self._await_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._request_arrived()
            super().connection_lost(exc)

        def _await_request(self) -> None:
            waiting[self] = None
            self._deadline = self.loop.call_later(read_timeout, self._expire)

        def _request_arrived(self) -> None:
            waiting.pop(self, None)
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._request_arrived()
            if not self.transport.is_closing():
                self.transport.close()

    return GuardedH11Protocol
