"""The gateway: the same starlette app `specserve serve` runs (WebSocket, OpenAI HTTP/SSE, chat
page, /health, /metrics), around a `ClusterEngine` instead of an `AsyncEngine`, served by
uvicorn in the process that calls `gateway_server` (`specserve serve --replicas N`).

Each turn streams from an engine replica over that replica's connection to this process
(`channel.py`), so a token crosses one hop (replica -> here) before its client. The app used
to run as a Serve ingress deployment behind Serve's HTTP proxy, two hops (replica -> gateway
replica -> proxy), which cost about 28 ms TTFT and 3.6 ms per token more than one server
(bench/RESULTS.md).
"""

from __future__ import annotations

from ray import serve

from ..server import ServerLimits, create_app, uvicorn_config
from ..server.drain import DrainingServer
from .app import PREFILL, REPLICAS, ROUTERS, ClusterOptions
from .gateway_engine import ClusterEngine


def gateway_server(app_name: str, options: ClusterOptions, host: str, port: int,
                   log_level: str = "info") -> DrainingServer:
    """The gateway of the running application `app_name`, ready to `run()` (until SIGTERM or
    SIGINT in the main thread, then a drain as one server's) or to `serve()` in a loop of
    the caller's. The replicas must be up: their facts are read here."""
    handle = serve.get_deployment_handle(REPLICAS, app_name)
    facts = handle.facts.remote().result()  # also builds the handle's `ReplicaSet`
    prefill = None
    if options.prefill_replicas:  # its handle's `ReplicaSet` brings their reports to /health
        prefill = serve.get_deployment_handle(PREFILL, app_name)
        prefill.stats.remote().result()
    router = ROUTERS[options.routing](**options.router_options)
    engine = ClusterEngine(handle, facts, options.num_replicas, options.stream_token, router,
                           report_period_s=options.stats_period_s, prefill_handle=prefill,
                           num_prefill_replicas=options.prefill_replicas)
    limits = ServerLimits.for_engine(engine, **options.limit_overrides)
    app = create_app(engine, limits=limits, **options.app_options)
    return DrainingServer(uvicorn_config(app, host, port, log_level),
                          app.state.server.admission, options.drain_timeout_s)
