"""Python SDK for the `specserve.v1` WebSocket protocol (docs/PROTOCOL.md): async and sync.

    async with AsyncClient("ws://127.0.0.1:8000", api_key=KEY) as client:
        stream = client.chat([{"role": "user", "content": "hi"}], temperature=0)
        async for text in stream:
            print(text, end="", flush=True)
        print(stream.usage, stream.metrics)

One socket carries any number of concurrent requests: each `chat`/`complete` call returns a
`ChatStream` with its own request id, and a reader task routes server events to the right
stream. `Client` is the same API for synchronous code; it runs an `AsyncClient` on a private
event-loop thread. Server `error` events and failed requests raise `SpecserveError` (or a
subclass) with the server's `code`, `message` and `param`.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from urllib.parse import urlsplit, urlunsplit

import orjson

SUBPROTOCOL = "specserve.v1"
_CLOSE_UNAUTHORIZED = 4401


class SpecserveError(Exception):
    """An `error` event or a failed request, as the server described it."""

    def __init__(self, code: str, message: str, param: str | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(f"[{code}] {message}" + (f" (param: {param})" if param else ""))
        self.code = code
        self.message = message
        self.param = param
        self.request_id = request_id


class AuthenticationError(SpecserveError):
    """The server wants an API key and got none or a wrong one."""


class ConnectionClosedError(SpecserveError):
    """The socket closed while a request was still in flight."""


class RequestFailedError(SpecserveError):
    """The request ended with `response.done` status `failed` (an engine error)."""


@dataclass
class ChatResult:
    """What a finished request came to."""

    request_id: str
    text: str
    status: str  # completed | incomplete | cancelled | failed
    reason: str
    usage: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


def _ws_url(url: str) -> str:
    """Accept http(s)://host:port or ws(s)://host:port[/path]; default path /v1/ws."""
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path if parts.path not in ("", "/") else "/v1/ws"
    return urlunsplit((scheme, parts.netloc, path, parts.query, ""))


class ChatStream:
    """One request: an async iterator of text deltas, then its usage, metrics and status.

    The request is sent on first iteration (or `await stream.start()`). Iteration ends after
    `response.done`; a cancelled request ends quietly with `status == "cancelled"`.
    """

    def __init__(self, client: AsyncClient, request_id: str, response: dict) -> None:
        self.client = client
        self.request_id = request_id
        self.response = response  # the `response` object of response.create
        self.queue: asyncio.Queue[dict] = asyncio.Queue()
        self.parts: list[str] = []
        self.steps: list[dict] = []  # (n_tokens, n_draft_accepted) per delta event
        self.created: dict | None = None
        self.status: str | None = None
        self.reason: str | None = None
        self.usage: dict = {}
        self.metrics: dict = {}
        self._started = False
        self._done = False

    @property
    def text(self) -> str:
        return "".join(self.parts)

    @property
    def done(self) -> bool:
        return self._done

    async def start(self) -> None:
        if not self._started:
            self._started = True
            await self.client._send({"type": "response.create", "request_id": self.request_id,
                                     "response": self.response})

    async def cancel(self) -> None:
        """Ask the server to stop; iteration then ends with status "cancelled"."""
        if self._started and not self._done:
            await self.client._send({"type": "response.cancel", "request_id": self.request_id})

    def __aiter__(self) -> ChatStream:
        return self

    async def __anext__(self) -> str:
        while (event := await self._next_event()) is not None:
            if event["type"] == "response.output_text.delta" and event["delta"]:
                return event["delta"]
        raise StopAsyncIteration

    async def events(self) -> AsyncIterator[dict]:
        """Every server event of this request, raw; ends after `response.done`."""
        while (event := await self._next_event()) is not None:
            yield event

    async def _next_event(self) -> dict | None:
        """The next event after bookkeeping; None once the request is over."""
        await self.start()
        if self._done:
            return None
        event = await self.queue.get()
        kind = event["type"]
        if kind == "response.output_text.delta":
            self.parts.append(event["delta"])
            self.steps.append({"n_tokens": event["n_tokens"],
                               "n_draft_accepted": event.get("n_draft_accepted", 0)})
        elif kind == "response.created":
            self.created = event["response"]
        elif kind == "response.done":
            self._finish(event)
            if self.status == "failed":
                err = event.get("error") or {}
                raise RequestFailedError(err.get("code", "engine_error"),
                                         err.get("message", "request failed"),
                                         request_id=self.request_id)
        elif kind == "error":
            self._done = True
            self.client._streams.pop(self.request_id, None)
            raise SpecserveError(event["code"], event["message"], event.get("param"),
                                 self.request_id)
        elif kind == "_closed":
            self._done = True
            raise ConnectionClosedError("connection_closed", event["message"],
                                        request_id=self.request_id)
        return event

    def _finish(self, event: dict) -> None:
        self._done = True
        self.client._streams.pop(self.request_id, None)
        self.status, self.reason = event["status"], event["reason"]
        self.usage, self.metrics = event.get("usage", {}), event.get("metrics", {})

    async def result(self) -> ChatResult:
        """Run the request to its end (if not done yet) and return the whole of it."""
        async for _ in self.events():
            pass
        return ChatResult(self.request_id, self.text, self.status or "", self.reason or "",
                          self.usage, self.metrics)


class AsyncClient:
    def __init__(self, url: str = "ws://127.0.0.1:8000", *, api_key: str | None = None,
                 open_timeout: float = 10.0, max_size: int = 16 * 2**20) -> None:
        self.url = _ws_url(url)
        self.api_key = api_key
        self.open_timeout = open_timeout
        self.max_size = max_size
        self.session: dict = {}  # the server's session object (model, limits, defaults)
        self._ws = None
        self._reader: asyncio.Task | None = None
        self._streams: dict[str, ChatStream] = {}
        self._waiters: dict[str, asyncio.Future] = {}  # event_id -> pong / session.updated
        self._ids = itertools.count()
        self.errors: list[SpecserveError] = []  # error events tied to no request or waiter

    async def connect(self) -> AsyncClient:
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None
        # No compression (frames are tiny) and no proxy lookup (a local server is the norm).
        self._ws = await connect(self.url, subprotocols=[SUBPROTOCOL], compression=None,
                                 additional_headers=headers, open_timeout=self.open_timeout,
                                 max_size=self.max_size, proxy=None)
        try:
            first = orjson.loads(await asyncio.wait_for(self._ws.recv(), self.open_timeout))
        except ConnectionClosed as exc:
            await self._ws.close()
            code = exc.rcvd.code if exc.rcvd else 1006
            reason = exc.rcvd.reason if exc.rcvd else "connection closed"
            cls = AuthenticationError if code == _CLOSE_UNAUTHORIZED else SpecserveError
            raise cls("unauthorized" if code == _CLOSE_UNAUTHORIZED else "connection_closed",
                      f"{reason} (close code {code})") from exc
        if first.get("type") != "session.created":
            await self._ws.close()
            raise SpecserveError("protocol_error", f"expected session.created, got {first}")
        self.session = first["session"]
        self._reader = asyncio.create_task(self._read())
        return self

    async def close(self) -> None:
        """Close the socket; the server cancels whatever was still running on it."""
        if self._ws is not None:
            await self._ws.close()
        if self._reader is not None:
            await self._reader
            self._reader = None

    async def __aenter__(self) -> AsyncClient:
        return await self.connect()

    async def __aexit__(self, *exc) -> None:
        await self.close()

    # ---- requests -----------------------------------------------------------------------
    def chat(self, messages: Sequence[dict], *, request_id: str | None = None,
             **params) -> ChatStream:
        """Stream an assistant reply to `messages` ({role, content} dicts).

        params: temperature, top_p, top_k, seed, stop, max_output_tokens, ignore_eos,
        speculation, speculation_events (see docs/PROTOCOL.md); None means the default.
        """
        return self._stream({"messages": list(messages)}, request_id, params)

    def complete(self, prompt: str | Sequence[int], *, request_id: str | None = None,
                 **params) -> ChatStream:
        """Stream a raw continuation of `prompt` (text or token ids); params as in `chat`."""
        return self._stream({"prompt": prompt if isinstance(prompt, str) else list(prompt)},
                            request_id, params)

    def _stream(self, response: dict, request_id: str | None, params: dict) -> ChatStream:
        if self._ws is None:
            raise SpecserveError("not_connected", "call connect() first")
        response.update({k: v for k, v in params.items() if v is not None})
        rid = request_id or f"c{next(self._ids)}"
        stream = ChatStream(self, rid, response)
        self._streams[rid] = stream
        return stream

    async def ping(self) -> float:
        """Application-level round trip to the server, in seconds."""
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        await self._request({"type": "ping"})
        return loop.time() - t0

    async def update_session(self, **defaults) -> dict:
        """Set per-socket defaults for later requests; returns the new session object."""
        event = await self._request({"type": "session.update",
                                     "session": {"defaults": defaults}})
        self.session = event["session"]
        return self.session

    async def _request(self, event: dict) -> dict:
        event_id = f"e{next(self._ids)}"
        future = asyncio.get_running_loop().create_future()
        self._waiters[event_id] = future
        try:
            await self._send({**event, "event_id": event_id})
            return await future
        finally:
            self._waiters.pop(event_id, None)

    async def _send(self, event: dict) -> None:
        if self._ws is None:
            raise SpecserveError("not_connected", "call connect() first")
        await self._ws.send(orjson.dumps(event).decode())

    async def _read(self) -> None:
        from websockets.exceptions import ConnectionClosed

        reason = "connection closed"
        try:
            async for raw in self._ws:
                event = orjson.loads(raw)
                stream = self._streams.get(event.get("request_id"))
                if stream is not None:
                    stream.queue.put_nowait(event)
                    continue
                waiter = self._waiters.get(event.get("event_id"))
                if waiter is not None and not waiter.done():
                    if event["type"] == "error":
                        waiter.set_exception(SpecserveError(event["code"], event["message"],
                                                            event.get("param")))
                    else:
                        waiter.set_result(event)
                elif event.get("type") == "error":
                    self.errors.append(SpecserveError(event["code"], event["message"],
                                                      event.get("param"),
                                                      event.get("request_id")))
        except ConnectionClosed as exc:
            reason = f"connection closed ({exc})"
        finally:
            for stream in list(self._streams.values()):
                stream.queue.put_nowait({"type": "_closed", "message": reason})
            for waiter in self._waiters.values():
                if not waiter.done():
                    waiter.set_exception(ConnectionClosedError("connection_closed", reason))


class SyncChatStream:
    """`ChatStream` for synchronous code: iterate for text deltas, then read the results."""

    def __init__(self, client: Client, stream: ChatStream) -> None:
        self._client = client
        self._stream = stream

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        try:
            return self._client._call(self._stream.__anext__())
        except StopAsyncIteration:
            raise StopIteration from None

    def cancel(self) -> None:
        self._client._call(self._stream.cancel())

    def result(self) -> ChatResult:
        return self._client._call(self._stream.result())

    def __getattr__(self, name: str):  # text, status, reason, usage, metrics, steps, ...
        return getattr(self._stream, name)


class Client:
    """Synchronous client: an `AsyncClient` running on a private event-loop thread."""

    def __init__(self, url: str = "ws://127.0.0.1:8000", *, api_key: str | None = None,
                 timeout: float | None = 300.0, **options) -> None:
        self.timeout = timeout
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name="specserve-client", daemon=True)
        self._thread.start()
        self._async = AsyncClient(url, api_key=api_key, **options)
        try:
            self._call(self._async.connect())
        except BaseException:
            self._stop_loop()
            raise

    @property
    def session(self) -> dict:
        return self._async.session

    def _call(self, coro):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(self.timeout)
        except BaseException:
            # Ctrl-C or a timeout: stop the coroutine too, or it would go on consuming events.
            future.cancel()
            raise

    def chat(self, messages: Sequence[dict], **params) -> SyncChatStream:
        return SyncChatStream(self, self._call(self._make("chat", messages, params)))

    def complete(self, prompt: str | Sequence[int], **params) -> SyncChatStream:
        return SyncChatStream(self, self._call(self._make("complete", prompt, params)))

    async def _make(self, kind: str, arg, params: dict) -> ChatStream:
        return getattr(self._async, kind)(arg, **params)  # on the loop thread: owns the queue

    def ping(self) -> float:
        return self._call(self._async.ping())

    def update_session(self, **defaults) -> dict:
        return self._call(self._async.update_session(**defaults))

    def close(self) -> None:
        try:
            self._call(self._async.close())
        finally:
            self._stop_loop()

    def _stop_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
