"""`/metrics`: Prometheus text, with the speculative-decoding counter names vLLM uses.

Engine-wide counters live in `EngineCore.stats` and are read at scrape time by a custom collector,
so the engine's hot loop never touches Prometheus objects. The server's own per-request
observations (finished requests by status, TTFT and end-to-end histograms, open sockets) are
ordinary prometheus_client metrics updated once per finished request, never per token.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ..engine import AsyncEngine

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Latency buckets in seconds: chat TTFT and e2e span a few ms (tiny models) to tens of seconds.
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


class _EngineCollector:
    """Reads `EngineStats` and the block pool when Prometheus scrapes."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def describe(self) -> list[Metric]:
        return []  # names are only known at collect time; no duplicate checks needed

    def collect(self) -> Iterator[Metric]:
        model = [self.model_name]
        stats, blocks = self.engine.stats, self.engine.kv_pool()

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric(model, value)
            return family

        # The names and meanings vLLM exports, so its dashboards work unchanged.
        yield counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.",
                      stats.num_drafts)
        yield counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
                      stats.num_draft_tokens)
        yield counter("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
                      stats.num_accepted_tokens)
        per_pos = CounterMetricFamily("vllm:spec_decode_num_accepted_tokens_per_pos",
                                      "Accepted tokens per draft position.",
                                      labels=["model_name", "position"])
        # The engine thread may append to this list while we read; a copy is a consistent view.
        for pos, n in enumerate(list(stats.accepted_per_pos)):
            per_pos.add_metric([self.model_name, str(pos)], n)
        yield per_pos

        yield counter("specserve_engine_steps", "Engine steps run.", stats.num_steps)
        yield counter("specserve_prompt_tokens", "Prompt tokens computed (prefix-cache hits "
                      "excluded).", stats.num_prompt_tokens)
        yield counter("specserve_generation_tokens", "Output tokens committed.",
                      stats.num_generation_tokens)
        yield counter("specserve_engine_requests_finished", "Requests the engine finished.",
                      stats.num_finished)
        phases = CounterMetricFamily("specserve_engine_step_seconds",
                                     "Engine time by step phase.", labels=["model_name", "phase"])
        for phase in ("schedule", "draft", "target_forward", "verify", "commit"):
            phases.add_metric([self.model_name, phase], getattr(stats, f"{phase}_time_s"))
        yield phases
        yield gauge("specserve_acceptance_length", "Tokens committed per target forward for "
                    "drafted steps since start.", stats.acceptance_length)
        yield gauge("specserve_requests_in_flight", "Requests in the engine.",
                    self.engine.num_in_flight())
        yield gauge("specserve_kv_blocks_total", "KV blocks in the pool.", blocks.num_blocks)
        yield gauge("specserve_kv_blocks_free", "KV blocks not held by a request.",
                    blocks.num_free_blocks)
        yield gauge("specserve_prefix_cache_hit_rate", "Full prompt blocks found in the prefix "
                    "cache, of those looked up.", blocks.prefix_hit_rate)

        # vLLM's load gauges (names, meanings, types), read by Kubernetes inference gateways'
        # endpoint pickers to route between servers.
        if hasattr(self.engine, "request_counts"):  # a cluster gateway: its replicas' split
            running, waiting = self.engine.request_counts()
        else:
            running, waiting = scheduler_counts(self.engine.num_in_flight(),
                                                self.engine.limits.max_num_seqs)
        yield gauge("vllm:num_requests_running", "Number of requests in model execution "
                    "batches.", running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
                    waiting)
        usage = 1.0 - blocks.num_free_blocks / blocks.num_blocks if blocks.num_blocks else 0.0
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
                    usage)
        if hasattr(self.engine, "replicas"):
            yield from replica_gauges(self.model_name, self.engine.replicas())


# Behind a cluster gateway, each replica's own numbers: (metric suffix, its key, help).
_REPLICA_GAUGES = (
    ("up", None, "1 while the replica's engine runs and its reports keep coming."),
    ("requests_in_flight", "requests_in_flight", "Requests in the replica's engine."),
    ("requests_waiting", "requests_waiting", "Requests queued in the replica's scheduler."),
    ("kv_cache_usage_perc", "kv_cache_usage_perc", "The replica's KV-cache usage (1: full)."),
    ("prefix_cache_hit_rate", "prefix_cache_hit_rate", "The replica's prefix-cache hit rate."),
    ("memory_bytes", "memory_bytes", "The replica process's resident memory."),
)


def replica_gauges(model_name: str, replicas: list[dict]) -> Iterator[Metric]:
    """`specserve_replica_*{replica=...}`: one series per live replica (`ClusterEngine
    .replicas`); the vLLM gauges above stay the cluster's totals."""
    for suffix, key, doc in _REPLICA_GAUGES:
        family = GaugeMetricFamily(f"specserve_replica_{suffix}", doc,
                                   labels=["model_name", "replica"])
        for r in replicas:
            value = float(r["status"] == "ok") if key is None else r[key]
            family.add_metric([model_name, r["replica"]], value)
        yield family


def scheduler_counts(in_flight: int, max_num_seqs: int) -> tuple[int, int]:
    """(running, waiting): the scheduler runs at most `max_num_seqs` requests side by side and
    queues the rest (the engine interface exposes their sum, `num_in_flight`)."""
    running = min(in_flight, max_num_seqs)
    return running, in_flight - running


class ServerMetrics:
    """One registry per app, so several apps in one process (tests) do not collide."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_EngineCollector(engine, model_name))
        self.requests = Counter("specserve_requests", "Requests finished, by API and status.",
                                ["api", "status"], registry=self.registry)
        self.ttft = Histogram("specserve_time_to_first_token_seconds",
                              "Arrival to first committed token.", ["api"],
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram("specserve_e2e_request_latency_seconds",
                             "Arrival to finish.", ["api"], buckets=_LATENCY_BUCKETS,
                             registry=self.registry)
        self.sessions = Gauge("specserve_websocket_sessions", "Open WebSocket sessions.",
                              registry=self.registry)

    def observe(self, api: str, status: str, metrics: dict | None) -> None:
        """Record one finished request (`metrics` is the engine's dict, seconds)."""
        self.requests.labels(api, status).inc()
        if metrics and metrics.get("num_output_tokens"):
            self.ttft.labels(api).observe(metrics["ttft_s"])
            self.e2e.labels(api).observe(metrics["e2e_s"])

    def render(self) -> bytes:
        return generate_latest(self.registry)


def request_metrics(m: dict | None) -> dict:
    """The engine's per-request metrics (seconds) as clients get them (ms, tokens/s)."""
    if not m:
        return {}
    n_out = m.get("num_output_tokens", 0)
    decode_s = m["e2e_s"] - m["ttft_s"]
    replica = {"replica": m["replica"]} if "replica" in m else {}  # set behind a cluster gateway
    # Set on a decode server when the prompt's KV came from a prefill server.
    transfer = ({"kv_transfer_ms": round(m["kv_transfer_ms"], 3)} if "kv_transfer_ms" in m
                else {})
    return {**replica, **transfer,
        "queue_ms": round(m["queue_s"] * 1e3, 3),
        "ttft_ms": round(m["ttft_s"] * 1e3, 3),
        "e2e_ms": round(m["e2e_s"] * 1e3, 3),
        # Decode speed: the first token's latency is TTFT's business, not this number's.
        "tokens_per_s": round((n_out - 1) / decode_s, 2) if n_out >= 2 and decode_s > 0 else 0.0,
        "acceptance_length": round(m["acceptance_length"], 4),
        "num_drafts": m["num_drafts"],
        "num_draft_tokens": m["num_draft_tokens"],
        "num_accepted_tokens": m["num_accepted_tokens"],
        "accepted_per_pos": m["accepted_per_pos"],
        "acceptance_rate_per_pos": [round(r, 4) for r in m.get("acceptance_rate_per_pos", [])],
        "draft_ms": round(m.get("draft_time_s", 0.0) * 1e3, 3),
        "verify_ms": round(m.get("target_forward_time_s", 0.0) * 1e3, 3),
        "num_prefix_cached_tokens": m.get("num_prefix_cached_tokens", 0),
        "num_preemptions": m.get("num_preemptions", 0),
    }
