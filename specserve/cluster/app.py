"""The Ray Serve application: a gateway deployment (the starlette app, through `serve.ingress`)
in front of N engine replicas.

    specserve serve --replicas N [--ray-address ADDR]

The gateway is the same app `specserve serve` runs (WebSocket, OpenAI HTTP/SSE, chat page,
/health, /metrics), built inside the gateway's replica around a `ClusterEngine` instead of an
`AsyncEngine`. The replicas are one deployment of N copies of `EngineReplica`, routed by
`PrefixAffinityRouter` (or `RoundRobinRouter`, the benchmark's baseline). Ray restarts a
replica that dies (its health check fails or its actor is gone) and the router stops choosing
it meanwhile. With `prefill_replicas`, a third deployment prefills every prompt and the engine
replicas decode only (`prefill_pool.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.handle import DeploymentHandle

from .gateway_engine import ClusterEngine
from .prefill_pool import PrefillReplica
from .replica import EngineReplica
from .router import PrefixAffinityRouter, RoundRobinRouter

GATEWAY = "gateway"
REPLICAS = "engine"
PREFILL = "prefill"
ROUTERS = {"prefix": PrefixAffinityRouter, "round_robin": RoundRobinRouter}


@dataclass(frozen=True)
class ClusterOptions:
    """How to build the application (every value must pickle: Ray ships it to the replicas)."""

    engine_options: dict  # build_engine_config's keyword options, the same on every replica
    num_replicas: int = 2
    app_options: dict = field(default_factory=dict)  # create_app's keyword options
    limit_overrides: dict = field(default_factory=dict)  # ServerLimits.for_engine's overrides
    cpus_per_replica: float = 1.0
    max_ongoing_requests: int = 64  # per engine replica, queued in its engine beyond its batch
    stats_period_s: float = 1.0  # how often each replica reports its load and KV pool
    routing: str = "prefix"  # a key of ROUTERS: "round_robin" is the benchmark's baseline
    router_options: dict = field(default_factory=dict)  # the router's initialize_state options
    drain_timeout_s: float = 20.0  # on shutdown, how long streams in flight may run on
    # > 0: that many prefill replicas, and the engine replicas decode only (prefill_pool.py)
    prefill_replicas: int = 0
    kv_token: str | None = None  # the prefill replicas' KV ports require it (--kv-token)

    def __post_init__(self) -> None:
        if isinstance(self.num_replicas, bool) or not isinstance(self.num_replicas, int) \
                or self.num_replicas < 1:
            raise ValueError(f"--replicas must be an integer >= 1, got {self.num_replicas!r}")
        if self.routing not in ROUTERS:
            raise ValueError(f"routing must be one of {', '.join(ROUTERS)}, got "
                             f"{self.routing!r}")
        if isinstance(self.prefill_replicas, bool) or not isinstance(self.prefill_replicas, int) \
                or self.prefill_replicas < 0:
            raise ValueError(f"--prefill-replicas must be an integer >= 0, got "
                             f"{self.prefill_replicas!r}")
        if self.cpus_per_replica <= 0 or self.max_ongoing_requests < 1 \
                or self.drain_timeout_s < 0:
            raise ValueError("cpus_per_replica must be > 0, max_ongoing_requests >= 1 and "
                             "drain_timeout_s >= 0")


class Gateway:
    """The ingress deployment: holds the replicas' handle and serves the starlette app."""

    async def __init__(self, replicas: DeploymentHandle, options: ClusterOptions) -> None:
        facts = await replicas.facts.remote()
        self.engine = ClusterEngine(replicas, facts, options.num_replicas,
                                    report_period_s=options.stats_period_s)
        self.options = options

    def __serve_build_asgi_app__(self):
        # Ray Serve calls this after __init__, in the gateway's process, and runs the app's
        # lifespan (which starts and stops the ClusterEngine) as uvicorn would.
        from ..server import ServerLimits, create_app

        limits = ServerLimits.for_engine(self.engine, **self.options.limit_overrides)
        return create_app(self.engine, limits=limits, **self.options.app_options)


def build_application(options: ClusterOptions) -> serve.Application:
    router = RequestRouterConfig(request_router_class=ROUTERS[options.routing],
                                 request_router_kwargs=options.router_options,
                                 request_routing_stats_period_s=options.stats_period_s)
    prefill_pool = None
    if options.prefill_replicas:
        prefill_pool = serve.deployment(
            PrefillReplica, name=PREFILL, num_replicas=options.prefill_replicas,
            ray_actor_options={"num_cpus": options.cpus_per_replica},
            max_ongoing_requests=options.max_ongoing_requests,
            health_check_period_s=2, health_check_timeout_s=10,
            graceful_shutdown_timeout_s=options.drain_timeout_s,
        ).bind(options.engine_options, options.kv_token)
    replicas = serve.deployment(
        EngineReplica, name=REPLICAS, num_replicas=options.num_replicas,
        ray_actor_options={"num_cpus": options.cpus_per_replica},
        max_ongoing_requests=options.max_ongoing_requests,
        request_router_config=router,
        health_check_period_s=2, health_check_timeout_s=10,
        graceful_shutdown_timeout_s=options.drain_timeout_s,
    ).bind(options.engine_options, prefill_pool, options.kv_token)
    gateway = serve.deployment(
        serve.ingress()(Gateway), name=GATEWAY, num_replicas=1,
        ray_actor_options={"num_cpus": 0},
        # Admission control (429 / overloaded) lives in the gateway; Ray must not refuse first.
        max_ongoing_requests=100_000,
        graceful_shutdown_timeout_s=options.drain_timeout_s,
    )
    return gateway.bind(replicas, options)
