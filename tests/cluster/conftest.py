"""One local Ray cluster per test module (2 CPUs, no dashboard), serving two replicas of the
tiny target (itself as the draft, chain:3) behind the gateway, which runs in a thread of the
test process on a free port, as `specserve serve --replicas` runs it in its main thread. Each
replica runs 2 requests side by side and the gateway queues 1 more: admission's cap is
2 x 2 + 1 = 5."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the cluster extra (ray[serve]) is not installed")
serve = pytest.importorskip("ray.serve")

from specserve.cluster import ClusterOptions, build_application  # noqa: E402
from specserve.cluster.gateway import gateway_server  # noqa: E402

APP = "specserve"

SPEC = "chain:3"
NUM_BLOCKS = 64
NUM_REPLICAS = 2
MAX_NUM_SEQS = 2  # per replica
MAX_QUEUED = 1  # at the gateway, beyond every replica's batch slots


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Cluster:
    def __init__(self, port: int) -> None:
        self.port = port
        self.http = f"http://127.0.0.1:{port}"
        self.ws = f"ws://127.0.0.1:{port}/v1/ws"


def serve_cluster(tiny_target: Path, **overrides):
    """Start the module's local Ray cluster, the application (the options below, with
    `overrides`) and its gateway; yields a `Cluster`; after, stops the gateway (a drain, as on
    SIGTERM) and takes the whole local cluster down."""
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    gateway = thread = None
    try:
        serve.start(proxy_location="Disabled")
        options = dict(  # noqa: C408
            engine_options={"target": str(tiny_target), "draft": str(tiny_target),
                            "speculation": SPEC, "num_blocks": NUM_BLOCKS,
                            "max_num_seqs": MAX_NUM_SEQS},
            num_replicas=NUM_REPLICAS, app_options={"model_name": "tiny"},
            limit_overrides={"max_queued_requests": MAX_QUEUED},
            cpus_per_replica=0.5, stats_period_s=0.2, drain_timeout_s=2)
        options = ClusterOptions(**{**options, **overrides})
        serve.run(build_application(options), name=APP, route_prefix=None)
        # A free port can be taken between the probe and the gateway's bind (Ray's processes
        # bind ports of their own): a gateway that exits before it starts tries another.
        for _ in range(3):
            port = free_port()
            gateway = gateway_server(APP, options, "127.0.0.1", port, log_level="warning")
            thread = threading.Thread(target=gateway.run, name="gateway", daemon=True)
            thread.start()
            deadline = time.monotonic() + 30
            while not gateway.started and thread.is_alive():
                assert time.monotonic() < deadline, "the gateway did not start"
                time.sleep(0.05)
            if gateway.started:
                break
        assert gateway.started, "the gateway could not bind a port"
        yield Cluster(port)
    finally:
        if thread is not None:
            gateway.should_exit = True
            thread.join(30)
        # The local cluster goes whole (its Serve actors with it): serve.shutdown() would first
        # wait for the replica the fault test killed to finish restarting.
        ray.shutdown()


@pytest.fixture(scope="module")
def cluster(tiny_target: Path):
    yield from serve_cluster(tiny_target)
