"""Prefill and decode pools on Ray Serve: `specserve serve --replicas N --prefill-replicas M`.

With M > 0 the application has a second deployment, M `PrefillReplica`s, and its N engine
replicas decode only: each new prompt goes to the prefill pool through its deployment handle
(Ray picks the least-loaded prefill replica), which answers the first token and
`kv_transfer_params`, and the engine replica pulls the KV blocks over TCP from that prefill
replica's KV port, as a plain decode server does from `--prefill-url` (specserve.disagg).
Cancelling the handle call (the client went away) cancels the prefill on its replica, which
frees its blocks; a transfer that was answered but not pulled is released by the decode side.
"""

from __future__ import annotations

import asyncio
import time

import msgspec
import ray
from ray.serve.handle import DeploymentHandle

from ..disagg.decode import PrefillUnavailable
from ..disagg.prefill import SAMPLING_FIELDS, PrefillEngine
from ..disagg.protocol import KVTransferParams
from ..sampling import SamplingParams
from .memory import resident_bytes


class PrefillReplica:
    """The prefill deployment's class: one `PrefillEngine` and its KV port."""

    async def __init__(self, engine_options: dict, kv_token: str | None = None) -> None:
        from ..engine.core import EngineCore  # the model code: only where a model loads
        from ..llm import build_engine_config

        core = EngineCore(build_engine_config(**engine_options))
        # Listen on every interface, and name this node's address: decode replicas may run
        # on other machines.
        self.engine = PrefillEngine(core, "0.0.0.0", 0, ray.util.get_node_ip_address(),
                                    kv_token=kv_token)
        await self.engine.start()

    async def prefill(self, prompt_token_ids: list[int], sampling: dict,
                      speculation=None) -> dict:
        return await self.engine.prefill(prompt_token_ids, sampling, speculation)

    def stats(self) -> dict:
        """Its KV pool and the transfers it holds (through the handle, for operators)."""
        pool = self.engine.kv_pool()
        return {"num_blocks": pool.num_blocks, "num_free_blocks": pool.num_free_blocks,
                "num_held": self.engine.handoff.num_held,
                "num_in_flight": self.engine.num_in_flight()}

    async def record_routing_stats(self) -> dict:
        """`stats` with the wall-clock time, whether the engine runs, and the process's
        memory, for the gateway's /health (Serve polls it as it does the engine replicas')."""
        return {**self.stats(), "time": time.time(), "running": self.engine.running,
                "rss_bytes": resident_bytes()}

    async def check_health(self) -> None:
        if not self.engine.running:
            raise RuntimeError("the prefill engine is not running")

    async def __del__(self) -> None:
        engine = getattr(self, "engine", None)  # None when __init__ failed
        if engine is not None:
            await engine.shutdown()


class PoolPrefillClient:
    """The decode side's `PrefillClient`, over the prefill deployment's handle."""

    def __init__(self, handle: DeploymentHandle) -> None:
        self.handle = handle

    async def prefill(self, prompt_token_ids: list[int], params: SamplingParams,
                      speculation) -> tuple[int, KVTransferParams]:
        sampling = {k: getattr(params, k) for k in SAMPLING_FIELDS}
        response = self.handle.prefill.remote(prompt_token_ids, sampling, speculation)
        try:
            answer = await response
        except asyncio.CancelledError:
            response.cancel()  # awaiting it is not the call: cancel the replica's prefill too
            raise
        except Exception as exc:  # a bad prompt or a dead replica: the request's error
            raise PrefillUnavailable(f"the prefill pool failed: "
                                     f"{getattr(exc, 'cause', None) or exc}") from exc
        return (int(answer["first_token"]),
                msgspec.convert(answer["kv_transfer_params"], KVTransferParams))

    async def aclose(self) -> None:
        pass  # the handle belongs to Ray
