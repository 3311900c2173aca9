"""Load-test a running specserve server: TTFT, TPOT, ITL, latency, throughput, goodput.

    python -m bench.serve --url ws://127.0.0.1:8000 --num-requests 64 --concurrency 4
    python -m bench.serve --backend openai --request-rate 2 --duration 60 --seed 1
    python -m bench.serve --sweep 1,4,16,32 --num-requests 64 --result-json out/sweep.json
    python -m bench.serve --prompts chats.jsonl --ignore-eos --goodput ttft_ms=500,tpot_ms=50

Backends. `ws` (the default) speaks the `specserve.v1` WebSocket protocol (docs/PROTOCOL.md)
with one request at a time per socket; sockets are pooled and reused, and a run at concurrency
N opens its N sockets before its clock starts. `openai` streams `POST /v1/chat/completions`
(server-sent events, `stream_options.include_usage`) with httpx.

Load. `--concurrency N` keeps N requests in flight (a closed loop). `--request-rate R` starts
requests at Poisson arrival times, R per second on average, seeded by `--seed`; `--concurrency`
then caps how many are in flight. A run stops starting requests after `--num-requests` or
`--duration` seconds, whichever comes first, and waits for those in flight. `--sweep 1,4,16`
runs each concurrency level in turn against the same server and plots the results.

Prompts. The built-in set (`bench/prompts.py`, questions about the Python standard library,
the demo model's domain) or `--prompts FILE.jsonl`, one `{"messages": [...], "max_tokens": N}`
per line (`max_tokens` optional; `--max-tokens` fills it in). Requests take the chats in a
seeded shuffled order, cycling.

What is measured, on the client's clock, from the moment a request is sent:
- TTFT: until the first delta carrying a token (WS: `n_tokens > 0`; SSE: the first chunk with
  text).
- E2E latency: until the end of the response (`response.done`; SSE: `data: [DONE]`).
- TPOT, per request: (E2E - TTFT) / (output tokens - 1); a one-token reply has none.
- ITL, per token: a delta that brings n tokens g seconds after the previous delta contributes n
  values g / n, so that a speculative step's burst counts as n tokens at the step's pace rather
  than one long gap and n - 1 zero gaps. Tokens of the first delta get no ITL (they are in the
  TTFT). The OpenAI stream does not say how many tokens a chunk holds, so over SSE the ITL is per
  chunk; the summary's `itl_basis` says which ("token" or "chunk").
- Output tokens: what the server reports (`usage`, the deltas' `n_tokens`), never re-tokenized.
- Goodput: completed requests per second that meet every `--goodput` limit (`ttft_ms`,
  `tpot_ms`, `e2e_ms`); a reply without a TPOT meets the TPOT limit.
- Acceptance length: per request, from `response.done` metrics (WS only; the OpenAI stream does
  not carry metrics).
Throughputs count completed requests only. A request that gets an `error`, a `failed` or
`cancelled` status, a non-200 answer, a broken connection or no answer within
`--request-timeout` is counted as failed, with its message.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import orjson

from bench.prompts import builtin_chats

GOODPUT_KEYS = ("ttft_ms", "tpot_ms", "e2e_ms")
WARMUP_MAX_TOKENS = 16


class BenchError(Exception):
    """The benchmark cannot run at all: server unreachable, unreadable prompts, bad option."""


# ---- configuration ------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchConfig:
    """Everything the command line says; `levels` has one entry per run."""

    url: str = "ws://127.0.0.1:8000"
    backend: str = "ws"  # ws | openai
    api_key: str | None = None
    model: str | None = None  # the OpenAI `model` field (default: the server's, /v1/models)
    prompts: str | None = None  # a .jsonl of chats (default: the built-in set)
    num_requests: int | None = 64  # per run; None: until `duration`
    duration: float | None = None  # seconds per run; None: until `num_requests`
    concurrency: int | None = None  # closed loop width; with request_rate, a cap (None: none)
    request_rate: float | None = None  # Poisson arrivals per second; None: closed loop
    sweep: tuple[int, ...] = ()  # concurrency levels, one run each
    max_tokens: int = 128
    temperature: float = 0.0
    speculation: str | None = None
    ignore_eos: bool = False
    goodput: dict[str, float] = field(default_factory=dict)  # key in GOODPUT_KEYS -> limit
    seed: int = 0
    warmup: int = 1  # requests sent (and not recorded) before the first run
    request_timeout: float = 300.0
    result_json: str | None = None
    plot: str | None = None
    progress: bool = True

    @property
    def levels(self) -> list[int | None]:
        """The concurrency of each run."""
        return list(self.sweep) if self.sweep else [self.concurrency]

    @property
    def plot_path(self) -> Path | None:
        if self.plot:
            return Path(self.plot)
        if self.sweep and self.result_json:
            return Path(self.result_json).with_suffix(".png")
        return None

    @property
    def ws_url(self) -> str:
        return _endpoint(self.url, ("ws", "wss"), "/v1/ws")

    @property
    def http_url(self) -> str:
        return _endpoint(self.url, ("http", "https"), "")


def _endpoint(url: str, schemes: tuple[str, str], path: str) -> str:
    """`url`'s host and port (any of ws, wss, http, https; bare host:port = ws) with `path`."""
    parts = urlsplit(url if "://" in url else f"ws://{url}")
    secure = parts.scheme in ("wss", "https")
    return urlunsplit((schemes[secure], parts.netloc, path, "", ""))


def parse_goodput(spec: str | None) -> dict[str, float]:
    """`"ttft_ms=500,tpot_ms=50"` -> `{"ttft_ms": 500.0, "tpot_ms": 50.0}`."""
    limits: dict[str, float] = {}
    for item in (spec or "").split(","):
        if not item.strip():
            continue
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in GOODPUT_KEYS:
            raise ValueError(f"bad --goodput item {item!r}: use KEY=MS with KEY one of "
                             f"{', '.join(GOODPUT_KEYS)}")
        limits[key] = float(value)
    return limits


def _levels(spec: str) -> tuple[int, ...]:
    levels = tuple(int(x) for x in spec.split(",") if x.strip())
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("--sweep takes positive integers, e.g. 1,4,16,32")
    return levels


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="ws://127.0.0.1:8000",
                   help="the server (ws://, http:// or host:port; default %(default)s)")
    p.add_argument("--backend", choices=("ws", "openai"), default="ws",
                   help="ws: the specserve.v1 WebSocket; openai: /v1/chat/completions SSE")
    p.add_argument("--api-key", default=os.environ.get("SPECSERVE_API_KEY"), metavar="KEY",
                   help="sent as `Authorization: Bearer KEY` (default: $SPECSERVE_API_KEY)")
    p.add_argument("--model", metavar="ID", help="OpenAI `model` field (default: the server's)")
    p.add_argument("--prompts", metavar="FILE.jsonl",
                   help='chats, one {"messages": [...], "max_tokens": N} per line '
                   "(default: the built-in stdlib questions)")
    p.add_argument("--num-requests", type=int, metavar="N",
                   help="requests per run (default: 64, or unbounded with --duration)")
    p.add_argument("--duration", type=float, metavar="S",
                   help="stop starting requests after this many s")
    p.add_argument("--concurrency", type=int, metavar="N",
                   help="requests in flight (default 1); with --request-rate, a cap")
    p.add_argument("--request-rate", type=float, metavar="R", help="Poisson arrivals per second")
    p.add_argument("--sweep", type=_levels, metavar="N,N,...",
                   help="run these concurrency levels in turn; plots them")
    p.add_argument("--max-tokens", type=int, default=128, metavar="N",
                   help="output tokens per request unless its chat says (default 128)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy (the default)")
    p.add_argument("--speculation", metavar="MODE",
                   help="the request's speculation mode (default: the server's)")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens")
    p.add_argument("--goodput", metavar="ttft_ms=..,tpot_ms=..",
                   help="limits a request must meet to count towards goodput")
    p.add_argument("--seed", type=int, default=0, metavar="N",
                   help="prompt order and arrival times")
    p.add_argument("--warmup", type=int, default=1, metavar="N",
                   help="unrecorded requests sent first")
    p.add_argument("--request-timeout", type=float, default=300.0, metavar="S",
                   help="seconds per request")
    p.add_argument("--result-json", metavar="PATH", help="write config, summaries and requests")
    p.add_argument("--plot", metavar="PATH",
                   help="PNG of latency percentiles and throughput vs concurrency "
                   "(default with --sweep: next to --result-json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.split("\n")[2:7]))
    add_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    num_requests = args.num_requests
    if num_requests is None and args.duration is None:
        num_requests = 64
    for name in ("num_requests", "concurrency", "max_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be at least 1")
    if args.request_rate is not None and args.request_rate <= 0:
        raise BenchError("--request-rate must be positive")
    try:
        goodput = parse_goodput(args.goodput)
    except ValueError as exc:
        raise BenchError(str(exc)) from None
    return BenchConfig(
        url=args.url, backend=args.backend, api_key=args.api_key, model=args.model,
        prompts=args.prompts, num_requests=num_requests, duration=args.duration,
        concurrency=args.concurrency, request_rate=args.request_rate,
        sweep=tuple(args.sweep or ()), max_tokens=args.max_tokens,
        temperature=args.temperature, speculation=args.speculation,
        ignore_eos=args.ignore_eos, goodput=goodput, seed=args.seed, warmup=args.warmup,
        request_timeout=args.request_timeout, result_json=args.result_json, plot=args.plot,
        progress=not args.no_progress)


# ---- prompts ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Chat:
    """One prompt: chat messages ending with a user turn."""

    messages: list[dict]
    max_tokens: int | None = None  # None: --max-tokens


def load_chats(path: str | None) -> list[Chat]:
    """The chats of a .jsonl file, or the built-in set when `path` is None."""
    if path is None:
        return [Chat(messages) for messages in builtin_chats()]
    chats = []
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as exc:
        raise BenchError(f"cannot read {path}: {exc}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            messages, max_tokens = item["messages"], item.get("max_tokens")
            if not isinstance(messages, list) or not messages:
                raise ValueError("`messages` must be a non-empty list")
            if max_tokens is not None and not isinstance(max_tokens, int):
                raise ValueError("`max_tokens` must be an integer")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BenchError(f"{path}:{number}: not a chat ({exc})") from None
        chats.append(Chat(messages, max_tokens))
    if not chats:
        raise BenchError(f"{path}: no chats")
    return chats


# ---- one request --------------------------------------------------------------------------
@dataclass
class RequestRecord:
    """One request as the client saw it. Times are seconds since it was sent."""

    index: int
    chat_index: int
    sent_at_s: float = 0.0  # since the run started
    ok: bool = False
    error: str | None = None
    finish: str | None = None  # WS status/reason, or the OpenAI finish_reason
    input_tokens: int | None = None
    output_tokens: int = 0
    ttft_s: float | None = None
    e2e_s: float | None = None
    chunk_times_s: list[float] = field(default_factory=list)  # each delta that brought tokens
    chunk_tokens: list[int] | None = field(default_factory=list)  # their counts; None: unknown
    acceptance_length: float | None = None

    def add_chunk(self, t: float, n_tokens: int | None) -> None:
        if self.ttft_s is None:
            self.ttft_s = t
        self.chunk_times_s.append(t)
        if n_tokens is None:
            self.chunk_tokens = None
        elif self.chunk_tokens is not None:
            self.chunk_tokens.append(n_tokens)

    def fail(self, message: str) -> None:
        self.ok = False
        self.error = self.error or message

    @property
    def tpot_s(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.ttft_s is None or self.e2e_s is None:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def itl_s(self) -> list[float]:
        """Per-token gaps (a delta's gap spread over its tokens); per chunk when unknown."""
        times = self.chunk_times_s
        gaps = [b - a for a, b in zip(times, times[1:])]
        if self.chunk_tokens is None:
            return gaps
        return [g / n for g, n in zip(gaps, self.chunk_tokens[1:]) for _ in range(n)]

    def as_dict(self) -> dict:
        return {**asdict(self), "tpot_s": self.tpot_s}


# ---- backends -----------------------------------------------------------------------------
def _request_fields(config: BenchConfig, chat: Chat) -> dict:
    """The sampling fields both backends send (WS names; OpenAI renames max_output_tokens)."""
    body = {"messages": chat.messages, "temperature": config.temperature,
            "max_output_tokens": config.max_tokens if chat.max_tokens is None else chat.max_tokens}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.speculation is not None:
        body["speculation"] = config.speculation
    return body


class WebSocketBackend:
    """`specserve.v1` over WebSocket: one request at a time per socket, sockets reused."""

    name = "ws"
    itl_basis = "token"

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self._idle: list = []  # open sockets not serving a request

    async def start(self, connections: int) -> None:
        """Open sockets until `connections` are idle (so a run's clock excludes handshakes)."""
        missing = max(0, connections - len(self._idle))
        self._idle += await asyncio.gather(*(self._connect() for _ in range(missing)))

    async def _connect(self):
        from websockets.asyncio.client import connect
        from websockets.exceptions import ConnectionClosed, InvalidHandshake

        key = self.config.api_key
        headers = {"Authorization": f"Bearer {key}"} if key else None
        url = self.config.ws_url
        ws = None
        try:
            ws = await connect(url, subprotocols=["specserve.v1"], compression=None,
                               additional_headers=headers, open_timeout=10, proxy=None,
                               max_size=None)
            first = orjson.loads(await asyncio.wait_for(ws.recv(), 10))
        except (OSError, InvalidHandshake, ConnectionClosed, asyncio.TimeoutError) as exc:
            if ws is not None:  # connected, but no session.created: do not leak the socket
                await ws.close()
            raise BenchError(f"cannot connect to {url}: {type(exc).__name__}: {exc}") from exc
        if first.get("type") != "session.created":
            await ws.close()
            raise BenchError(f"{url}: expected session.created, got {first}")
        return ws

    async def request(self, record: RequestRecord, chat: Chat) -> None:
        ws = self._idle.pop() if self._idle else await self._connect()
        reusable = False
        try:
            reusable = await self._exchange(ws, record, chat)
        finally:
            if reusable:
                self._idle.append(ws)
            else:  # broken, or abandoned mid-request: closing cancels it on the server
                await ws.close()

    async def _exchange(self, ws, record: RequestRecord, chat: Chat) -> bool:
        """Send one request and read its events; True when the socket is fit for reuse."""
        rid = f"r{record.index}"
        event = {"type": "response.create", "request_id": rid,
                 "response": _request_fields(self.config, chat)}
        t0 = time.perf_counter()
        await ws.send(orjson.dumps(event).decode())
        while True:
            raw = await ws.recv()
            now = time.perf_counter() - t0
            event = orjson.loads(raw)
            if event.get("request_id") != rid:
                continue
            kind = event["type"]
            if kind == "response.output_text.delta" and event["n_tokens"] > 0:
                record.add_chunk(now, event["n_tokens"])
            elif kind == "response.created":
                record.input_tokens = event["response"].get("input_tokens")
            elif kind == "error":  # the request was not started
                record.fail(f"{event['code']}: {event['message']}")
                return True
            elif kind == "response.done":
                self._finish(record, event, now)
                return True

    @staticmethod
    def _finish(record: RequestRecord, done: dict, now: float) -> None:
        record.e2e_s = now
        record.finish = f"{done['status']}/{done.get('reason')}"
        usage = done.get("usage") or {}
        record.output_tokens = usage.get("output_tokens", sum(record.chunk_tokens or []))
        record.input_tokens = usage.get("input_tokens", record.input_tokens)
        record.acceptance_length = (done.get("metrics") or {}).get("acceptance_length")
        if done["status"] in ("completed", "incomplete"):
            record.ok = True
        else:
            error = done.get("error") or {}
            record.fail(error.get("message") or f"request {record.finish}")

    async def close(self) -> None:
        idle, self._idle = self._idle, []
        await asyncio.gather(*(ws.close() for ws in idle), return_exceptions=True)


class OpenAIBackend:
    """`POST /v1/chat/completions` with `stream: true`, read as server-sent events (httpx)."""

    name = "openai"
    itl_basis = "chunk"

    def __init__(self, config: BenchConfig) -> None:
        self.config = config
        self.model = config.model
        self._client = None

    async def start(self, connections: int) -> None:
        import httpx

        if self._client is not None:
            return
        headers = {"Authorization": f"Bearer {self.config.api_key}"} if self.config.api_key \
            else {}
        self._client = httpx.AsyncClient(
            base_url=self.config.http_url, headers=headers, trust_env=False,
            timeout=httpx.Timeout(self.config.request_timeout, connect=10),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))
        if self.model is None:
            try:
                response = await self._client.get("/v1/models")
                response.raise_for_status()
                self.model = response.json()["data"][0]["id"]
            except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
                await self.close()
                raise BenchError(f"cannot list the models of {self.config.http_url}: "
                                 f"{type(exc).__name__}: {exc}") from exc

    async def request(self, record: RequestRecord, chat: Chat) -> None:
        body = _request_fields(self.config, chat)
        body["max_tokens"] = body.pop("max_output_tokens")
        body.update(model=self.model, stream=True, stream_options={"include_usage": True})
        t0 = time.perf_counter()
        async with self._client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                record.fail(_http_error(response.status_code, await response.aread()))
                return
            async for line in response.aiter_lines():
                now = time.perf_counter() - t0
                if line.startswith("data:") and self._on_data(record, line[5:].strip(), now):
                    break
        if record.e2e_s is None:
            record.fail("the stream ended without data: [DONE]")
        elif record.finish not in ("stop", "length"):
            record.fail(f"finish_reason {record.finish}")
        elif record.output_tokens == 0 and record.input_tokens is None:
            record.fail("no usage chunk")
        else:
            record.ok = record.error is None

    @staticmethod
    def _on_data(record: RequestRecord, data: str, now: float) -> bool:
        """Take one SSE `data:` payload; True at `[DONE]`."""
        if data == "[DONE]":
            record.e2e_s = now
            return True
        chunk = orjson.loads(data)
        if "error" in chunk:
            record.fail(str(chunk["error"].get("message", chunk["error"])))
        for choice in chunk.get("choices") or []:
            if (choice.get("delta") or {}).get("content"):
                record.add_chunk(now, None)
            if choice.get("finish_reason"):
                record.finish = choice["finish_reason"]
        if chunk.get("usage"):
            record.output_tokens = chunk["usage"]["completion_tokens"]
            record.input_tokens = chunk["usage"]["prompt_tokens"]
        return False

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


def _http_error(status: int, body: bytes) -> str:
    try:
        error = orjson.loads(body)["error"]
        return f"HTTP {status} {error.get('code')}: {error.get('message')}"
    except (ValueError, KeyError, TypeError):
        return f"HTTP {status}: {body[:200].decode(errors='replace')}"


BACKENDS = {"ws": WebSocketBackend, "openai": OpenAIBackend}


# ---- load generation ----------------------------------------------------------------------
async def _timed(backend, record: RequestRecord, chat: Chat, timeout: float) -> RequestRecord:
    """Run one request; any failure is written into the record, never raised."""
    try:
        await asyncio.wait_for(backend.request(record, chat), timeout)
    except asyncio.TimeoutError:
        record.fail(f"no complete answer within {timeout:g} s")
    except Exception as exc:  # a broken connection or a malformed answer: one failed request
        record.fail(f"{type(exc).__name__}: {exc}")
    return record


async def run_load(backend, chats: Sequence[Chat], config: BenchConfig,
                   concurrency: int | None, on_done: Callable[[], None] = lambda: None,
                   ) -> tuple[list[RequestRecord], float]:
    """One run: the finished records (in start order) and its duration in seconds."""
    order = list(range(len(chats)))
    random.Random(config.seed).shuffle(order)
    records: list[RequestRecord] = []
    start = time.perf_counter()

    async def serve(record: RequestRecord) -> None:
        record.sent_at_s = time.perf_counter() - start
        await _timed(backend, record, chats[record.chat_index], config.request_timeout)
        on_done()

    def next_request() -> Awaitable[None] | None:
        """The next request to send, numbered now; None once the run has enough."""
        if ((config.num_requests is not None and len(records) >= config.num_requests)
                or (config.duration is not None
                    and time.perf_counter() - start >= config.duration)):
            return None
        records.append(RequestRecord(len(records), order[len(records) % len(order)]))
        return serve(records[-1])

    if config.request_rate is None:
        await _closed_loop(next_request, concurrency or 1)
    else:
        await _poisson(next_request, config.request_rate, concurrency, config.seed)
    return records, time.perf_counter() - start


async def _closed_loop(next_request: Callable[[], Awaitable[None] | None],
                       concurrency: int) -> None:
    """`concurrency` workers, each sending its next request when the last one is done."""
    async def worker() -> None:
        while (request := next_request()) is not None:
            await request

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def _poisson(next_request: Callable[[], Awaitable[None] | None], rate: float,
                   cap: int | None, seed: int) -> None:
    """Requests arrive at seeded exponential intervals; with `cap`, at most that many run at
    once and the others wait their turn (their clock starts when they are sent)."""
    rng = random.Random(seed)
    gate = asyncio.Semaphore(cap) if cap else None

    async def gated(request: Awaitable[None]) -> None:
        if gate is None:
            return await request
        async with gate:
            await request

    tasks = []
    due = time.perf_counter()
    while True:
        await asyncio.sleep(max(0.0, due - time.perf_counter()))
        request = next_request()
        if request is None:
            break
        tasks.append(asyncio.create_task(gated(request)))
        due += rng.expovariate(rate)
    await asyncio.gather(*tasks)


# ---- summary ------------------------------------------------------------------------------
def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


@dataclass
class Stats:
    """Mean and percentiles of one sample."""

    mean: float
    median: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float], scale: float = 1.0) -> Stats | None:
        if not values:
            return None
        v = sorted(x * scale for x in values)
        return cls(sum(v) / len(v), percentile(v, 50), percentile(v, 90), percentile(v, 99))


@dataclass
class RunSummary:
    """What one run came to: counts, rates and latency statistics (ms)."""

    backend: str
    concurrency: int | None
    request_rate: float | None
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens of completed requests / s
    goodput: float | None  # completed requests meeting every --goodput limit / s
    ttft_ms: Stats | None
    tpot_ms: Stats | None
    itl_ms: Stats | None
    e2e_ms: Stats | None
    acceptance_length: Stats | None
    itl_basis: str  # "token": per-token ITL; "chunk": per SSE chunk
    errors: dict[str, int]  # message -> count, the most common few


def meets(record: RequestRecord, limits: dict[str, float]) -> bool:
    values_ms = {"ttft_ms": record.ttft_s, "tpot_ms": record.tpot_s, "e2e_ms": record.e2e_s}
    return all(values_ms[key] is None or values_ms[key] * 1e3 <= limit
               for key, limit in limits.items())


def summarize(records: Sequence[RequestRecord], duration_s: float, config: BenchConfig,
              backend, concurrency: int | None) -> RunSummary:
    ok = [r for r in records if r.ok]
    acceptance = [r.acceptance_length for r in ok if r.acceptance_length is not None]
    errors = Counter(r.error for r in records if not r.ok)
    output_tokens = sum(r.output_tokens for r in ok)
    return RunSummary(
        backend=backend.name, concurrency=concurrency, request_rate=config.request_rate,
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        total_input_tokens=sum(r.input_tokens or 0 for r in ok),
        total_output_tokens=output_tokens,
        request_throughput=len(ok) / duration_s,
        output_throughput=output_tokens / duration_s,
        goodput=(sum(meets(r, config.goodput) for r in ok) / duration_s
                 if config.goodput else None),
        ttft_ms=Stats.of([r.ttft_s for r in ok if r.ttft_s is not None], 1e3),
        tpot_ms=Stats.of([r.tpot_s for r in ok if r.tpot_s is not None], 1e3),
        itl_ms=Stats.of([gap for r in ok for gap in r.itl_s()], 1e3),
        e2e_ms=Stats.of([r.e2e_s for r in ok], 1e3),
        acceptance_length=Stats.of(acceptance),
        itl_basis=backend.itl_basis,
        errors=dict(errors.most_common(5)))


# ---- report -------------------------------------------------------------------------------
def _fmt(value: float | None, digits: int = 2) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def format_summary(s: RunSummary, config: BenchConfig) -> str:
    """The end-of-run table."""
    load = (f"concurrency {s.concurrency or 1}" if s.request_rate is None else
            f"rate {s.request_rate:g} req/s" + (f", cap {s.concurrency}" if s.concurrency else ""))
    rows = [("Backend / URL", f"{s.backend}  {config.url}"),
            ("Load", load),
            ("Completed / failed requests", f"{s.completed} / {s.failed}"),
            ("Duration (s)", _fmt(s.duration_s)),
            ("Input / output tokens", f"{s.total_input_tokens} / {s.total_output_tokens}"),
            ("Request throughput (req/s)", _fmt(s.request_throughput, 3)),
            ("Output token throughput (tok/s)", _fmt(s.output_throughput)),
            ("Goodput (req/s)", _fmt(s.goodput, 3) + (f"  ({_limits(config.goodput)})"
                                                      if config.goodput else "")),
            ("Acceptance length (mean / p50)",
             f"{_fmt(s.acceptance_length.mean)} / {_fmt(s.acceptance_length.median)}"
             if s.acceptance_length else "n/a")]
    width = 64
    lines = [f"{' Serving benchmark ':=^{width}}"]
    lines += [f"{name:<34}{value}" for name, value in rows]
    lines.append(f"{'':-^{width}}")
    lines.append(f"{'latency (ms)':<18}{'mean':>11}{'p50':>11}{'p90':>11}{'p99':>11}")
    itl = "ITL per token" if s.itl_basis == "token" else "ITL per chunk"
    for name, stats in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), (itl, s.itl_ms),
                        ("E2E", s.e2e_ms)):
        cells = ([stats.mean, stats.median, stats.p90, stats.p99] if stats else [None] * 4)
        lines.append(f"{name:<18}" + "".join(f"{_fmt(c):>11}" for c in cells))
    for message, count in s.errors.items():
        lines.append(f"failed x{count}: {message}")
    lines.append("=" * width)
    return "\n".join(lines)


def format_sweep(summaries: Sequence[RunSummary]) -> str:
    """One line per run of a sweep."""
    head = (f"{'conc':>5}{'done':>6}{'fail':>6}{'req/s':>9}{'tok/s':>10}{'TTFT p50':>10}"
            f"{'TTFT p99':>10}{'TPOT p50':>10}{'TPOT p99':>10}")
    lines = [head]
    for s in summaries:
        def pick(stats: Stats | None, name: str) -> str:
            return _fmt(getattr(stats, name) if stats else None, 1)
        lines.append(f"{s.concurrency or 1:>5}{s.completed:>6}{s.failed:>6}"
                     f"{s.request_throughput:>9.3f}{s.output_throughput:>10.1f}"
                     f"{pick(s.ttft_ms, 'median'):>10}{pick(s.ttft_ms, 'p99'):>10}"
                     f"{pick(s.tpot_ms, 'median'):>10}{pick(s.tpot_ms, 'p99'):>10}")
    return "\n".join(lines)


def _limits(limits: dict[str, float]) -> str:
    return ", ".join(f"{k}<={v:g}" for k, v in limits.items())


def plot_runs(summaries: Sequence[RunSummary], path: Path) -> None:
    """TTFT and TPOT percentiles and throughput against concurrency, as a PNG."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    x = [s.concurrency or 1 for s in summaries]
    fig = Figure(figsize=(15, 4.5), layout="constrained")
    axes = fig.subplots(1, 3)
    for ax, name, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for q, style in (("median", "o-"), ("p90", "s--"), ("p99", "^:")):
            y = [getattr(getattr(s, name), q) if getattr(s, name) else math.nan
                 for s in summaries]
            ax.plot(x, y, style, label="p50" if q == "median" else q)
        ax.set(title=f"{title} percentiles", xlabel="concurrency", ylabel=f"{title} (ms)")
        ax.legend()
    axes[2].plot(x, [s.output_throughput for s in summaries], "o-", label="output tok/s")
    axes[2].set(title="throughput", xlabel="concurrency", ylabel="output tokens / s")
    twin = axes[2].twinx()
    twin.plot(x, [s.request_throughput for s in summaries], "s--", color="tab:orange",
              label="requests/s")
    twin.set_ylabel("requests / s")
    axes[2].legend(handles=axes[2].lines + twin.lines)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(x, [str(v) for v in x])
        ax.grid(alpha=0.3)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


# ---- the program --------------------------------------------------------------------------
async def benchmark(config: BenchConfig) -> dict:
    """Every run of `config` against the server; the result object `--result-json` writes."""
    from tqdm import tqdm

    chats = load_chats(config.prompts)
    backend = BACKENDS[config.backend](config)
    shown = asdict(config) | {"api_key": "<set>" if config.api_key else None}  # never the key
    result: dict = {"config": shown, "runs": []}
    try:
        await backend.start(max(level or 1 for level in config.levels))
        await _warm_up(backend, chats[0], config)
        for level in config.levels:
            await backend.start(level or 1)
            with tqdm(total=config.num_requests, desc=f"concurrency {level or 1}",
                      unit="req", disable=not config.progress, file=sys.stderr) as bar:
                records, duration = await run_load(backend, chats, config, level,
                                                   lambda b=bar: b.update(1))
            summary = summarize(records, duration, config, backend, level)
            result["runs"].append({"summary": asdict(summary),
                                   "requests": [r.as_dict() for r in records]})
            print(format_summary(summary, config), flush=True)
    finally:
        await backend.close()
    return result


async def _warm_up(backend, chat: Chat, config: BenchConfig) -> None:
    """A few short, unrecorded requests (lazy initialisation on the server is not measured)."""
    short = Chat(chat.messages, min(config.max_tokens, WARMUP_MAX_TOKENS))
    for i in range(config.warmup):
        record = await _timed(backend, RequestRecord(-1 - i, 0), short, config.request_timeout)
        if not record.ok:
            print(f"warm-up request failed: {record.error}", file=sys.stderr)


def write_outputs(result: dict, config: BenchConfig) -> None:
    if len(result["runs"]) > 1:
        print(format_sweep([_summary_of(run) for run in result["runs"]]))
    if config.result_json:
        path = Path(config.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))
        print(f"wrote {path}", file=sys.stderr)
    if config.plot_path:
        plot_runs([_summary_of(run) for run in result["runs"]], config.plot_path)
        print(f"wrote {config.plot_path}", file=sys.stderr)


def _summary_of(run: dict) -> RunSummary:
    fields = dict(run["summary"])
    for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "acceptance_length"):
        fields[name] = Stats(**fields[name]) if fields[name] else None
    return RunSummary(**fields)


async def main(argv: Sequence[str] | argparse.Namespace | None = None) -> dict:
    """Parse `argv` (or take parsed args), run every run, print and write the results."""
    args = argv if isinstance(argv, argparse.Namespace) else build_parser().parse_args(argv)
    config = config_from_args(args)
    result = await benchmark(config)
    write_outputs(result, config)
    return result


def run(argv: Sequence[str] | None = None, prog: str | None = None) -> int:
    """The command line: `python -m bench.serve ...` (from the repository root)."""
    args = build_parser(prog).parse_args(argv)
    try:
        asyncio.run(main(args))
    except BenchError as exc:
        print(f"{prog or 'bench.serve'}: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(run(prog="python -m bench.serve"))
