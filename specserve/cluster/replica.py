"""One engine replica: a Ray Serve deployment that holds one `AsyncEngine` with its own paged
KV cache and streams each turn's deltas back to the gateway.

A turn crosses the process boundary as a `Turn` (token ids already prepared by the gateway) and
comes back as the engine's own `RequestDelta`s, in lists (`batches`), through a streaming
deployment handle.
The replica reports its load and KV pool to Ray Serve (`record_routing_stats`), which hands the
numbers to the gateway's router and `/metrics`.
"""

from __future__ import annotations

import os
import time
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass

from ray import serve
from ray.serve.handle import DeploymentHandle

from ..engine import AsyncEngine, EngineLimits, EngineStoppedError, ModelInfo
from ..engine.async_engine import DeltaStream
from ..outputs import RequestDelta
from ..sampling import SamplingParams


@dataclass(frozen=True)
class Turn:
    """One engine request, as the gateway sends it to a replica."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    speculation: object  # the request's speculation spelling (None: the replica's default)
    session: str | None  # the conversation whose turns keep to one replica (None: any)


@dataclass(frozen=True)
class EngineFacts:
    """What the gateway needs of the engine without loading a model: every replica loads the
    same checkpoint, so any one replica's facts stand for all."""

    model_info: ModelInfo
    limits: EngineLimits
    tokenizer: object


class EngineReplica:
    """The deployment class: `serve.deployment(EngineReplica)` in `app.py`."""

    async def __init__(self, engine_options: dict, prefill_pool: DeploymentHandle | None = None,
                       kv_token: str | None = None) -> None:
        # Imported here: the core pulls in torch and the model code, which the gateway never
        # loads (it only holds a tokenizer).
        from ..engine.core import EngineCore
        from ..llm import build_engine_config

        core = EngineCore(build_engine_config(**engine_options))
        if prefill_pool is None:
            self.engine = AsyncEngine(core)
        else:  # a decode replica: prompts are prefilled on the pool (prefill_pool.py)
            from ..disagg.decode import DecodeEngine
            from ..disagg.transport import TcpKVClient
            from .prefill_pool import PoolPrefillClient

            self.engine = DecodeEngine(core, PoolPrefillClient(prefill_pool),
                                       TcpKVClient(token=kv_token))
        await self.engine.start()
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()

    def facts(self) -> EngineFacts:
        engine = self.engine
        return EngineFacts(engine.model_info, engine.limits, engine.tokenizer)

    async def generate(self, turn: Turn) -> AsyncIterator[list[RequestDelta]]:
        """Stream one turn's deltas (`batches`); the last one's metrics name this replica as
        "replica"."""
        try:
            stream = self.engine.add_request(turn.prompt_token_ids, turn.params,
                                             turn.request_id, turn.speculation)
        except (EngineStoppedError, ValueError) as exc:
            yield [RequestDelta(turn.request_id, [], "", finish_reason="error",
                                error=f"replica {self.replica_id}: {exc}")]
            return
        try:
            async for batch in batches(stream):
                last = batch[-1]
                if last.finished:
                    last.metrics = {**(last.metrics or {}), "replica": self.replica_id}
                yield batch
        finally:
            # The gateway cancels this generator when its client aborts or goes away: the
            # engine frees the request's blocks before its next step.
            stream.abort()

    def record_routing_stats(self) -> dict:
        """Load, KV and memory numbers for the gateway's /health and /metrics (Ray Serve polls
        this every `request_routing_stats_period_s` and hands it to the gateway's router).
        `time` (wall clock) lets the gateway tell a report that stopped coming."""
        engine = self.engine
        pool = engine.kv_pool()
        return {"time": time.time(), "running": engine.running,
                "num_in_flight": engine.num_in_flight(),
                "max_num_seqs": engine.limits.max_num_seqs,
                "num_blocks": pool.num_blocks, "num_free_blocks": pool.num_free_blocks,
                "prefix_hit_rate": pool.prefix_hit_rate, "rss_bytes": resident_bytes(),
                "stats": asdict(engine.stats)}

    def check_health(self) -> None:
        if not self.engine.running:
            raise RuntimeError(f"replica {self.replica_id}: the engine is not running")

    async def __del__(self) -> None:
        engine = getattr(self, "engine", None)  # None when __init__ failed
        if engine is not None:
            await engine.shutdown()


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


def resident_bytes() -> int:
    """This process's resident memory in bytes (Linux's /proc; 0 where unknown)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0
