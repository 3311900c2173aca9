"""One engine replica: a Ray Serve deployment that holds one `AsyncEngine` with its own paged
KV cache and streams each turn's deltas back to the gateway.

A turn crosses the process boundary as a `Turn` (token ids already prepared by the gateway) and
comes back as the engine's own `RequestDelta`s, in lists, over the replica's stream port
(`channel.py`), whose address the replica gives Ray Serve once (`record_replica_metadata`).
The replica reports its load and KV pool to Ray Serve (`record_routing_stats`), which hands the
numbers to the gateway's /health and /metrics.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from ..engine import AsyncEngine, EngineLimits, ModelInfo
from .channel import StreamServer
from .memory import resident_bytes


@dataclass(frozen=True)
class EngineFacts:
    """What the gateway needs of the engine without loading a model: every replica loads the
    same checkpoint, so any one replica's facts stand for all."""

    model_info: ModelInfo
    limits: EngineLimits
    tokenizer: object


class EngineReplica:
    """The deployment class: `serve.deployment(EngineReplica)` in `app.py`."""

    async def __init__(self, engine_options: dict, stream_token: str,
                       prefill_pool: DeploymentHandle | None = None,
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
        self.streams = StreamServer(self.engine, self.replica_id, stream_token)
        self.stream_port = await self.streams.start()

    def facts(self) -> EngineFacts:
        engine = self.engine
        return EngineFacts(engine.model_info, engine.limits, engine.tokenizer)

    def record_replica_metadata(self) -> dict:
        """Where the gateway opens this replica's token stream (Serve hands it to the gateway
        with the replica, before any report)."""
        return {"stream_host": ray.util.get_node_ip_address(), "stream_port": self.stream_port}

    async def record_routing_stats(self) -> dict:
        """Load, KV and memory numbers for the gateway's /health and /metrics (Ray Serve polls
        this every `request_routing_stats_period_s` and hands it to the gateway's router).
        `time` (wall clock) lets the gateway tell a report that stopped coming. A coroutine,
        as `check_health`: Serve runs a plain method in a worker thread, started per call."""
        engine = self.engine
        pool = engine.kv_pool()
        return {"time": time.time(), "running": engine.running,
                "num_in_flight": engine.num_in_flight(),
                "max_num_seqs": engine.limits.max_num_seqs,
                "num_blocks": pool.num_blocks, "num_free_blocks": pool.num_free_blocks,
                "prefix_hit_rate": pool.prefix_hit_rate, "rss_bytes": resident_bytes(),
                "stats": asdict(engine.stats)}

    async def check_health(self) -> None:
        if not self.engine.running:
            raise RuntimeError(f"replica {self.replica_id}: the engine is not running")

    async def __del__(self) -> None:
        streams = getattr(self, "streams", None)  # None when __init__ failed
        if streams is not None:
            await streams.close()
        engine = getattr(self, "engine", None)
        if engine is not None:
            await engine.shutdown()

