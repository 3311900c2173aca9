"""The token stream between the gateway and the engine replicas: one TCP connection from the
gateway to each replica, carrying every turn the gateway sends there and every delta back.

Ray Serve starts, restarts and health-checks the replicas and tells the gateway which are
alive; the turns themselves skip its request path. Through a streaming deployment handle a turn
cost about 4 ms from the gateway to the replica's method and 1.1-1.6 ms per message back (the
2-core bench machine, loaded: the router's thread, Serve's request metadata and admission
handshake, its gRPC framing and authentication interceptor on every call); this channel is one
length-prefixed msgpack frame each way per message on a connection opened once (0.9 ms to the
engine, 0.75-0.85 ms per message back on the same machine and load).

    gateway -> replica: Hello(token) once, then Generate(turn) / Abort(request_id)
    replica -> gateway: one list of `RequestDelta`s per frame: every delta of a turn ready when
                        its last one was sent (`batches`), those of every turn on the
                        connection sent in one pass of the replica's event loop (`Outbox`)

The replica's listening port takes any address (the gateway may run on another machine); the
first frame must carry the application's token, else the replica closes the connection.
A connection that ends (the replica died, or its process was killed) ends each of its turns
with `ReplicaGone`; when the gateway's connection ends, the replica aborts every turn it
carried (their blocks are freed).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import msgspec

from ..engine.async_engine import DeltaStream
from ..outputs import RequestDelta
from ..sampling import SamplingParams

log = logging.getLogger("specserve.cluster")

_HEADER = struct.Struct("!I")  # each frame: its body's length, then a msgpack body
# Frames longer than this end the connection: a garbage length must not make the reader
# buffer gigabytes (the longest real ones carry prompt log-probabilities, tens of MB).
MAX_FRAME = 256 << 20
MAX_HELLO = 1024  # the first frame, read before the peer has shown the token


@dataclass(frozen=True)
class Turn:
    """One engine request, as the gateway sends it to a replica."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    speculation: object  # the request's speculation spelling (None: the replica's default)
    session: str | None  # the conversation whose turns keep to one replica (None: any)


class Hello(msgspec.Struct, tag="hello", array_like=True):
    token: str


class Generate(msgspec.Struct, tag="generate", array_like=True):
    turn: Turn


class Abort(msgspec.Struct, tag="abort", array_like=True):
    request_id: str


class ReplicaGone(ConnectionError):
    """The connection to a turn's replica ended before the turn did."""


_encode = msgspec.msgpack.Encoder().encode
_to_replica = msgspec.msgpack.Decoder(Hello | Generate | Abort)
_to_gateway = msgspec.msgpack.Decoder(list[RequestDelta])


def _frame(message) -> bytes:
    body = _encode(message)
    return _HEADER.pack(len(body)) + body


async def _read_frame(reader: asyncio.StreamReader, limit: int = MAX_FRAME) -> bytes:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > limit:
        raise ConnectionAbortedError(f"a frame of {size} bytes (at most {limit})")
    return await reader.readexactly(size)


# ---- the replica's end ----------------------------------------------------------------------
class StreamServer:
    """Listens for the gateway; runs each `Generate` on `engine` and writes its deltas back.
    `name` goes into the last delta's metrics as "replica"."""

    def __init__(self, engine, name: str, token: str) -> None:
        self.engine, self.name, self.token = engine, name, token
        self._server: asyncio.Server | None = None
        # The open connections: each one's handler task and writer.
        self._connections: dict[asyncio.Task, asyncio.StreamWriter] = {}

    async def start(self, host: str = "0.0.0.0") -> int:
        """Listen on `host` (every interface by default) and a free port; returns the port."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        return self._server.sockets[0].getsockname()[1]

    async def close(self) -> None:
        """Stop listening, end every connection (the gateway's turns end at once) and wait
        for their handlers, which abort the turns."""
        if self._server is not None:
            self._server.close()
        for writer in list(self._connections.values()):
            writer.close()
        await asyncio.gather(*self._connections, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        turns: dict[str, asyncio.Task] = {}
        handler = asyncio.current_task()
        self._connections[handler] = writer
        outbox = Outbox(writer, turns)
        try:
            hello = _to_replica.decode(await _read_frame(reader, MAX_HELLO))
            if not (isinstance(hello, Hello) and hmac.compare_digest(hello.token, self.token)):
                log.warning("a stream connection without the application's token, closed")
                return
            while True:
                message = _to_replica.decode(await _read_frame(reader))
                if isinstance(message, Generate):
                    rid = message.turn.request_id
                    turns[rid] = asyncio.create_task(self._stream(message.turn, outbox))
                    turns[rid].add_done_callback(lambda t, rid=rid: turns.pop(rid, None))
                elif isinstance(message, Abort) and message.request_id in turns:
                    turns[message.request_id].cancel()
        except (asyncio.IncompleteReadError, ConnectionError, msgspec.DecodeError):
            pass  # the gateway went away (or spoke nonsense): its turns end below
        except asyncio.CancelledError:
            pass  # the replica's loop is closing: nothing waits for this handler
        finally:
            for task in list(turns.values()):
                task.cancel()
            del self._connections[handler]
            writer.close()

    async def _stream(self, turn: Turn, outbox: Outbox) -> None:
        try:
            stream = self.engine.add_request(turn.prompt_token_ids, turn.params,
                                             turn.request_id, turn.speculation)
        except Exception as exc:  # a bad request or a stopped engine: the turn's error
            outbox.send([RequestDelta(turn.request_id, [], "", finish_reason="error",
                                      error=f"replica {self.name}: {exc}")])
            return
        try:
            async for batch in batches(stream):
                last = batch[-1]
                if last.finished:
                    last.metrics = {**(last.metrics or {}), "replica": self.name}
                outbox.send(batch)
                await outbox.writer.drain()  # at once unless the gateway stopped reading
        except ConnectionError:
            pass  # the connection's end aborts the turn below
        finally:
            stream.abort()  # a no-op once it finished: else the engine frees its blocks


class Outbox:
    """One connection's way back to the gateway: the deltas every turn on it sends during one
    pass of the event loop go out as one frame. The engine hands a step's deltas to all its
    streams at once, so with n turns on a connection a step costs one write here and one
    read and decode at the gateway instead of n (16 turns of a fake engine stepping together
    on the 2-core bench machine: 40-46 us of CPU per delta for both ends against 56-58, p50
    from the step to the gateway 460-530 us against 700-730). A lone turn writes at once:
    nothing could join it, and waiting for the next pass would only add latency."""

    def __init__(self, writer: asyncio.StreamWriter, turns: dict) -> None:
        self.writer = writer
        self.turns = turns  # the connection's turns in flight
        self._pending: list[RequestDelta] = []

    def send(self, deltas: list[RequestDelta]) -> None:
        if len(self.turns) <= 1 and not self._pending:
            if not self.writer.is_closing():
                self.writer.write(_frame(deltas))
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.extend(deltas)

    def _flush(self) -> None:
        deltas, self._pending = self._pending, []
        if not self.writer.is_closing():
            self.writer.write(_frame(deltas))


async def batches(stream: DeltaStream) -> AsyncIterator[list[RequestDelta]]:
    """The stream's deltas, each list every delta ready when the last send was done: one per
    engine step while the gateway keeps up, more when this replica's event loop or its link
    fell behind, so a backlog costs one message instead of one per step. The same deltas in
    the same order, ending with the finished one."""
    while not stream.finished:
        batch = [await stream.queue.get()]
        while not batch[-1].finished and not stream.queue.empty():
            batch.append(stream.queue.get_nowait())
        stream.finished = batch[-1].finished
        yield batch


# ---- the gateway's end ----------------------------------------------------------------------
class ReplicaConnection:
    """The gateway's connection to one replica. `start` sends a turn; its deltas go to the
    turn's `deliver` callback as their frames arrive, and the returned future ends with the
    finished delta, or with `ReplicaGone` when the connection ends first."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._turns: dict[str, tuple[Callable[[RequestDelta], None], asyncio.Future]] = {}
        self.closed = False
        self._close_reason = "the gateway closed the connection"
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(cls, host: str, port: int, token: str) -> ReplicaConnection:
        """Connect (ConnectionError when the replica does not answer) and introduce."""
        reader, writer = await asyncio.open_connection(host, port)
        writer.write(_frame(Hello(token)))
        return cls(reader, writer)

    def start(self, turn: Turn, deliver: Callable[[RequestDelta], None]) -> asyncio.Future:
        done = asyncio.get_running_loop().create_future()
        if self.closed:
            done.set_exception(ReplicaGone("the connection to the replica is closed"))
            return done
        self._turns[turn.request_id] = (deliver, done)
        self._writer.write(_frame(Generate(turn)))
        return done

    def abort(self, request_id: str) -> None:
        """Stop a turn on the replica (its engine frees the blocks); its deltas stop here."""
        if self._turns.pop(request_id, None) is not None and not self.closed:
            self._writer.write(_frame(Abort(request_id)))

    def close(self, reason: str | None = None) -> None:
        """End the connection; its turns end with `ReplicaGone(reason)`."""
        if reason is not None:
            self._close_reason = reason
        self._task.cancel()

    def when_closed(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the connection has ended, whoever ended it."""
        self._task.add_done_callback(lambda _: callback())

    async def _read(self) -> None:
        reason = "the replica closed the connection"
        try:
            while True:
                for delta in _to_gateway.decode(await _read_frame(self._reader)):
                    entry = self._turns.get(delta.request_id)
                    if entry is None:
                        continue  # aborted here: its last deltas were on their way
                    entry[0](delta)
                    if delta.finished:
                        del self._turns[delta.request_id]
                        entry[1].set_result(None)
        except asyncio.IncompleteReadError:
            pass
        except asyncio.CancelledError:
            reason = self._close_reason
        except (ConnectionError, OSError, msgspec.DecodeError) as exc:
            reason = f"the connection to the replica failed ({type(exc).__name__}: {exc})"
        finally:
            self.closed = True
            self._writer.close()
            for _, done in self._turns.values():
                if not done.done():
                    done.set_exception(ReplicaGone(reason))
            self._turns.clear()
