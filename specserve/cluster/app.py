"""The Ray Serve application: N engine replicas, to which the gateway (`gateway.py`, in the
`specserve serve --replicas N [--ray-address ADDR]` process) sends each turn.

The replicas are one deployment of N copies of `EngineReplica`; the gateway routes each turn
itself (`PrefixAffinityRouter`, or `RoundRobinRouter`, the benchmark's baseline) among the live
replicas its handle's `ReplicaSet` knows, and streams it over the replica's own port
(`channel.py`). The application has no HTTP route of its own: Serve's HTTP proxy is not
started. Ray restarts a replica that dies (its health check fails or its actor is gone) and
the gateway stops choosing it meanwhile. With `prefill_replicas`, a second deployment
prefills every prompt and the engine replicas decode only (`prefill_pool.py`).
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field

from ray import serve
from ray.serve.config import RequestRouterConfig

from .prefill_pool import PrefillReplica
from .replica import EngineReplica
from .router import PrefixAffinityRouter, ReplicaSet, RoundRobinRouter

REPLICAS = "engine"
PREFILL = "prefill"
ROUTERS = {"prefix": PrefixAffinityRouter, "round_robin": RoundRobinRouter}
# No access log line per call: the gateway's own log has the requests, and each line would be
# written by the replica, shipped by Ray's log monitor and printed by the gateway's process.
LOGGING = {"enable_access_log": False}
# Each replica's methods run on its own event loop, not a thread of their own: its stream
# port (`channel.py`, started in `__init__`) then shares the loop Serve's calls run on, and
# nothing of ours blocks that loop once a replica has started: its engine steps in a thread.
RUNTIME_ENV = {"env_vars": {"RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0"}}


@dataclass(frozen=True)
class ClusterOptions:
    """How to build the application and its gateway (every value must pickle: Ray ships the
    engine options to the replicas)."""

    engine_options: dict  # build_engine_config's keyword options, the same on every replica
    num_replicas: int = 2
    app_options: dict = field(default_factory=dict)  # create_app's keyword options
    limit_overrides: dict = field(default_factory=dict)  # ServerLimits.for_engine's overrides
    cpus_per_replica: float = 1.0
    max_ongoing_requests: int = 64  # per engine replica, queued in its engine beyond its batch
    stats_period_s: float = 1.0  # how often each replica reports its load and KV pool
    routing: str = "prefix"  # a key of ROUTERS: "round_robin" is the benchmark's baseline
    router_options: dict = field(default_factory=dict)  # the routing policy's options
    drain_timeout_s: float = 20.0  # on shutdown, how long streams in flight may run on
    # > 0: that many prefill replicas, and the engine replicas decode only (prefill_pool.py)
    prefill_replicas: int = 0
    kv_token: str | None = None  # the prefill replicas' KV ports require it (--kv-token)
    # The engine replicas' stream ports (channel.py) require it: a fresh one per application.
    stream_token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)

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
        ROUTERS[self.routing](**self.router_options)  # bad options fail before Ray starts
        if self.cpus_per_replica <= 0 or self.max_ongoing_requests < 1 \
                or self.drain_timeout_s < 0:
            raise ValueError("cpus_per_replica must be > 0, max_ongoing_requests >= 1 and "
                             "drain_timeout_s >= 0")


def build_application(options: ClusterOptions) -> serve.Application:
    """The engine replicas (and the prefill pool) as one application; its ingress is the
    engine deployment, which `serve.run(..., route_prefix=None)` keeps off HTTP."""
    def router(deployment: str) -> RequestRouterConfig:
        return RequestRouterConfig(request_router_class=ReplicaSet,
                                   request_router_kwargs={"deployment": deployment},
                                   request_routing_stats_period_s=options.stats_period_s)

    prefill_pool = None
    if options.prefill_replicas:
        prefill_pool = serve.deployment(
            PrefillReplica, name=PREFILL, num_replicas=options.prefill_replicas,
            ray_actor_options={"num_cpus": options.cpus_per_replica,
                               "runtime_env": RUNTIME_ENV},
            max_ongoing_requests=options.max_ongoing_requests,
            request_router_config=router(PREFILL),
            health_check_period_s=2, health_check_timeout_s=10,
            graceful_shutdown_timeout_s=options.drain_timeout_s, logging_config=LOGGING,
        ).bind(options.engine_options, options.kv_token)
    return serve.deployment(
        EngineReplica, name=REPLICAS, num_replicas=options.num_replicas,
        ray_actor_options={"num_cpus": options.cpus_per_replica, "runtime_env": RUNTIME_ENV},
        max_ongoing_requests=options.max_ongoing_requests,
        request_router_config=router(REPLICAS),
        health_check_period_s=2, health_check_timeout_s=10,
        graceful_shutdown_timeout_s=options.drain_timeout_s, logging_config=LOGGING,
    ).bind(options.engine_options, options.stream_token, prefill_pool, options.kv_token)
