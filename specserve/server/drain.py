"""A graceful drain on SIGTERM/SIGINT: stop accepting, finish or end every stream, exit 0.

uvicorn on a signal closes its listeners, closes WebSockets at once with 1012 and cancels HTTP
tasks after `timeout_graceful_shutdown`, so streams end without their final event and the process
re-raises the signal (exit 143). `DrainingServer` puts a drain in front of that:

1. stop accepting connections; new requests on open ones are refused (`server_unavailable`);
2. let the streams in flight run for up to `drain_timeout` seconds;
3. abort what is left: each WebSocket request then ends with `response.done` status
   `cancelled`, reason `server_shutdown`, each SSE stream with an error chunk and `[DONE]`;
4. hand over to uvicorn's own shutdown (connections, lifespan: the engine thread stops).

The process exits 0. A second signal skips whatever waiting is left.
"""

from __future__ import annotations

import logging
import socket
import time
from types import FrameType

import uvicorn
from websockets.exceptions import InvalidState

from .admission import Admission

log = logging.getLogger("specserve.server")

# After the abort, how long the routes get to write their final events.
FINAL_EVENTS_TIMEOUT_S = 5.0


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, admission: Admission,
                 drain_timeout: float) -> None:
        super().__init__(config)
        self.admission = admission
        self.drain_timeout = drain_timeout

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not recorded for re-raising: a drained server has done what the signal asked.
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    def exit_without_drain(self) -> None:
        """Shut down with no drain wait (the engine can no longer serve): the requests in flight
        are ended at once with their final events. Safe to call from any thread."""
        self.drain_timeout = 0.0
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        await self.drain()
        for connection in list(self.server_state.connections):
            _tolerate_closing_handshake(connection)
        await super().shutdown(sockets=None)
        if self.force_exit:
            # uvicorn skips the lifespan's shutdown after a second signal; its task then died
            # cancelled at exit with a traceback, and the engine was never shut down.
            await self.lifespan.shutdown()

    async def drain(self) -> None:
        admission = self.admission
        admission.start_draining()
        if admission.active:
            log.info("draining %d request(s) for up to %g s", admission.active,
                     self.drain_timeout)
        if not await self._wait_idle(self.drain_timeout):
            log.info("drain timeout: ending %d request(s)", admission.abort_all())
            await self._wait_idle(FINAL_EVENTS_TIMEOUT_S)

    async def _wait_idle(self, timeout: float) -> bool:
        """Wait for every admitted request to end; False on timeout or a second signal."""
        deadline = time.monotonic() + timeout
        while not self.force_exit:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if await self.admission.wait_idle(min(left, 0.1)):
                return True
        return False


def _tolerate_closing_handshake(connection) -> None:
    """uvicorn's shutdown of a WebSocket connection sends a close frame, which websockets
    refuses (InvalidState) when the client's own close frame arrived first and the closing
    handshake is already under way; the exception then ended the process with exit code 1
    instead of 0. Such a connection only needs its transport closed."""
    shutdown = connection.shutdown

    def shutdown_once_closing() -> None:
        try:
            shutdown()
        except InvalidState:
            connection.transport.close()

    connection.shutdown = shutdown_once_closing
