"""Admission control: how many requests the server holds at once, and the drain on shutdown.

Every request, from any route, takes a `Ticket` before it is prepared and gives it back when its
stream has ended (or it was refused). The server holds at most the engine's batch slots plus
`max_queued_requests` tickets; past that a request is refused at once with `overloaded` (HTTP 429
and Retry-After), rather than queueing behind work it would wait minutes for. When the server
drains, new requests are refused with `server_unavailable`, and what is still running after the
drain timeout is aborted through the tickets (each route then sends its final event).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ..validation import RequestError

RETRY_AFTER_S = 1


class Ticket:
    """One admitted request, holding `weight` places (its engine requests: an OpenAI request
    with n choices holds n). `release` is idempotent; `abort` is set once a stream exists."""

    __slots__ = ("_admission", "abort", "released", "weight")

    def __init__(self, admission: Admission, weight: int) -> None:
        self._admission = admission
        self.weight = weight
        self.abort: Callable[[], None] | None = None
        self.released = False

    def attach(self, abort: Callable[[], None]) -> None:
        """The request's stream exists now; abort it at once if the drain is already over."""
        self.abort = abort
        if self._admission.aborting:
            abort()

    def release(self) -> None:
        if not self.released:
            self.released = True
            self._admission._release(self)


class Admission:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.draining = False
        self.aborting = False
        self._tickets: set[Ticket] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        self.num_refused = 0

    @property
    def active(self) -> int:
        """Places held: the engine requests of every admitted request."""
        return sum(ticket.weight for ticket in self._tickets)

    def admit(self, weight: int = 1) -> Ticket:
        """A ticket for `weight` engine requests, or RequestError `overloaded` (429) /
        `server_unavailable` (503)."""
        if self.draining:
            self.num_refused += 1
            raise RequestError("server_unavailable", "the server is shutting down",
                               http_status=503)
        if self.active + weight > self.capacity:
            self.num_refused += 1
            raise RequestError("overloaded", f"the server holds {self.capacity} requests "
                               f"already; retry in {RETRY_AFTER_S} s", http_status=429)
        ticket = Ticket(self, weight)
        self._tickets.add(ticket)
        self._idle.clear()
        return ticket

    def _release(self, ticket: Ticket) -> None:
        self._tickets.discard(ticket)
        if not self._tickets:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until every ticket is back; False if the timeout came first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except TimeoutError:
            return False
        return True

    def start_draining(self) -> None:
        self.draining = True

    def abort_all(self) -> int:
        """Abort every admitted request that has a stream; returns how many."""
        self.aborting = True
        aborted = 0
        for ticket in list(self._tickets):
            if ticket.abort is not None:
                ticket.abort()
                aborted += 1
        return aborted
