"""What the server layer costs: WebSocket round trips, per-event CPU, TTFT over WS vs direct.

    python -m bench server-overhead                 # tiny random model built on the fly
    python -m bench server-overhead --target DIR [--draft DIR --speculation S] [--n 200]

A real uvicorn (the app and settings `specserve serve` uses) runs on a thread of this process;
the WebSocket client runs in a child process, so its Python work does not compete for this
process's GIL with the engine and the server. Measured:

- ping RTT: `ping` -> `pong`, the protocol's floor (JSON parse, dispatch, one frame each way).
- one-token RTT: `response.create` with max_output_tokens=1 -> `response.done`, client clock.
- TTFT over WS (`response.create` sent -> first delta received, client clock) vs TTFT calling
  `AsyncEngine.add_request` directly on the server's own event loop (-> first delta, token ids
  given, so no tokenization), same engine and prompt, alternating in blocks.
- server CPU per event: CPU time of the uvicorn thread alone (Linux per-thread clock) while
  several long requests stream with speculation off (one token per event), divided by the
  events sent. It covers all event-loop work: receiving engine deltas, building and encoding
  events, websocket framing, socket writes; not the engine thread's forwards.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import tempfile
import time
from pathlib import Path

import orjson

BLOCK = 20  # WS and direct TTFT samples alternate in blocks of this many


def _pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _summary(name: str, ms: list[float]) -> str:
    return (f"{name:<34} p50 {statistics.median(ms):7.3f} ms   p90 {_pct(ms, 0.9):7.3f} ms   "
            f"min {min(ms):7.3f} ms   (n={len(ms)})")


# ---- the client process -------------------------------------------------------------------
def _client_main(url: str, prompt: str, conn) -> None:
    asyncio.run(_client(url, prompt, conn))


async def _client(url: str, prompt: str, conn) -> None:
    """Answers commands from the parent: ("ping", n), ("ttft", n), ("stream", k, tokens)."""
    from websockets.asyncio.client import connect

    ws = await connect(url, subprotocols=["specserve.v1"], compression=None, proxy=None)
    await ws.recv()  # session.created
    ids = iter(range(10**9))

    async def recv() -> dict:
        return orjson.loads(await ws.recv())

    async def create(max_tokens: int, **extra) -> str:
        rid = f"r{next(ids)}"
        await ws.send(orjson.dumps({"type": "response.create", "request_id": rid, "response": {
            "prompt": prompt, "max_output_tokens": max_tokens, "temperature": 0,
            **extra}}).decode())
        return rid

    while True:
        command = conn.recv()
        if command[0] == "quit":
            await ws.close()
            return
        if command[0] == "ping":
            out = []
            for i in range(command[1]):
                t0 = time.perf_counter()
                await ws.send(f'{{"type":"ping","event_id":"p{i}"}}')
                await recv()
                out.append((time.perf_counter() - t0) * 1e3)
            conn.send(out)
        elif command[0] == "ttft":
            ttft, rtt = [], []
            for _ in range(command[1]):
                t0 = time.perf_counter()
                await create(1)
                first = None
                while True:
                    kind = (await recv())["type"]
                    if kind == "response.output_text.delta" and first is None:
                        first = (time.perf_counter() - t0) * 1e3
                    if kind == "response.done":
                        rtt.append((time.perf_counter() - t0) * 1e3)
                        break
                ttft.append(first)
            conn.send((ttft, rtt))
        elif command[0] == "stream":
            _, k, tokens = command
            for _ in range(k):
                await create(tokens, ignore_eos=True, speculation="off")
            events = done = 0
            while done < k:
                events += 1
                done += (await recv())["type"] == "response.done"
            conn.send(events)


# ---- the server side ----------------------------------------------------------------------
class _ServerThread:
    """`specserve serve`'s app and uvicorn settings, on a thread of this process."""

    def __init__(self, target, draft, speculation) -> None:
        from bench.inprocess import serve_in_thread
        from specserve.engine.async_engine import AsyncEngine
        from specserve.engine.core import EngineCore
        from specserve.llm import build_engine_config
        from specserve.server import create_app

        self.engine = AsyncEngine(EngineCore(build_engine_config(target, draft, speculation)))
        self.server, self.thread, port = serve_in_thread(create_app(self.engine))
        self.ws = f"ws://127.0.0.1:{port}/v1/ws"

    def trace_server_ttft(self) -> list[float]:
        """Record, inside the server, frame received -> first delta handed to the socket (ms).

        Wraps two Session methods for the benchmark's sake: it separates the server's own
        share of the WebSocket TTFT from the network and the client's scheduling.
        """
        from specserve.server.ws import Session

        samples: list[float] = []
        on_frame, send = Session.on_frame, Session.send
        arrived: dict[int, float] = {}

        async def timed_on_frame(session, message):
            arrived[id(session)] = time.perf_counter()
            await on_frame(session, message)

        async def timed_send(session, event):
            if event["type"] == "response.output_text.delta" and event["seq"] == 0:
                samples.append((time.perf_counter() - arrived[id(session)]) * 1e3)
            await send(session, event)

        Session.on_frame, Session.send = timed_on_frame, timed_send
        return samples

    def cpu_time(self) -> float:
        """CPU seconds used by the uvicorn thread (its event loop) so far."""
        return time.clock_gettime(time.pthread_getcpuclockid(self.thread.ident))

    def direct_ttft(self, prompt: str, n: int) -> list[float]:
        """TTFT of add_request -> first delta, run on the server's event loop."""
        from specserve.sampling import SamplingParams

        engine = self.engine
        ids = engine.tokenizer.encode(prompt)
        params = SamplingParams(temperature=0, max_tokens=1)

        async def one() -> float:
            t0 = time.perf_counter()
            async for _ in engine.add_request(ids, params):
                return (time.perf_counter() - t0) * 1e3
            raise RuntimeError("stream ended without a delta")

        return [asyncio.run_coroutine_threadsafe(one(), engine._loop).result(30)
                for _ in range(n)]

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)


def measure(srv: _ServerThread, args) -> None:
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=_client_main,
                                           args=(srv.ws, args.prompt, child), daemon=True)
    proc.start()
    try:
        def ask(*command):
            parent.send(command)
            return parent.recv()

        ask("ttft", 10)
        srv.direct_ttft(args.prompt, 10)  # warm-up of both paths
        ping = ask("ping", args.n)
        server_side = srv.trace_server_ttft()
        ws_ttft, rtt, direct = [], [], []
        for _ in range(max(1, args.n // BLOCK)):
            ttft, round_trips = ask("ttft", BLOCK)
            ws_ttft += ttft
            rtt += round_trips
            direct += srv.direct_ttft(args.prompt, BLOCK)
        del server_side[len(ws_ttft):]  # keep the TTFT phase's samples only
        cpu0, wall0 = srv.cpu_time(), time.perf_counter()
        events = ask("stream", args.streams, args.tokens)
        cpu, wall = srv.cpu_time() - cpu0, time.perf_counter() - wall0
        parent.send(("quit",))
        proc.join(timeout=10)
    finally:
        if proc.is_alive():
            proc.kill()

    print(_summary("ping RTT (protocol floor)", ping))
    print(_summary("one-token request RTT", rtt))
    print(_summary("TTFT over WebSocket", ws_ttft))
    print(_summary("  of which inside the server", server_side))
    print(_summary("TTFT calling the engine directly", direct))
    med = statistics.median

    def over(samples: list[float]) -> str:
        return f"p50 {med(samples) - med(direct):.3f} ms, min {min(samples) - min(direct):.3f} ms"

    print(f"{'WebSocket TTFT overhead':<34} {over(ws_ttft)} (inside the server: "
          f"{over(server_side)})")
    print(f"server event-loop CPU per event    {cpu / events * 1e6:7.1f} us   ({events} events "
          f"from {args.streams} streams x {args.tokens} tokens in {wall:.2f} s; loop thread "
          f"busy {100 * cpu / wall:.1f}%)")


def main(argv: list[str] | None = None, prog: str = "python -m bench server-overhead") -> None:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n")[0])
    parser.add_argument("--target", help="target model folder (default: a tiny random model)")
    parser.add_argument("--draft")
    parser.add_argument("--speculation")
    parser.add_argument("--prompt", default="def add(a, b):")
    parser.add_argument("--n", type=int, default=200, help="samples per latency measurement")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=400)
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        target = args.target
        if target is None:
            from tests.tiny_models import save_model  # run from the repository root

            target = save_model(Path(tmp) / "tiny", "llama", seed=0)
            print(f"model: tiny random Llama (2 layers, hidden 64), CPU; {args.n} samples")
        else:
            print(f"model: {target} draft {args.draft} speculation {args.speculation}")
        srv = _ServerThread(target, args.draft, args.speculation)
        try:
            measure(srv, args)
        finally:
            srv.stop()
