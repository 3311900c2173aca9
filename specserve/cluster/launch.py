"""`specserve serve --replicas N [--ray-address ADDR]`: start or join a Ray cluster, run the
application on it, and serve until SIGTERM/SIGINT.

Without ADDR, `ray.init()` joins the Ray cluster this machine is part of (`RAY_ADDRESS`, or
the one `ray start` last started here) or starts a local one. Serve's HTTP proxy listens on
--host/--port on every node, so the same routes answer there as from the single-process
server. On exit the application is deleted (Serve drains its replicas first); a local cluster
this process started goes with it, a joined one keeps running.
"""

from __future__ import annotations

import signal
import sys
import threading

APP_NAME = "specserve"


def serve_forever(options, host: str, port: int, ray_address: str | None) -> int:
    import ray
    from ray import serve

    from .app import build_application

    application = build_application(options)  # bad options fail before Ray starts
    context = ray.init(address=ray_address, include_dashboard=False)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": host, "port": port})
        try:
            serve.run(application, name=APP_NAME, route_prefix="/")
        except RuntimeError as exc:  # a replica failed to start (Ray logged why above)
            print(f"specserve serve: the application did not start: {exc}", file=sys.stderr)
            return 1
        print(f"specserve: {options.num_replicas} engine replica(s) behind the gateway on "
              f"http://{host}:{port} (Ray cluster {context.address_info['address']})",
              file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        # Serve drains each replica (its graceful shutdown timeout) before deleting it. Bounded:
        # a signal sent to the whole process group may have ended Ray's own processes too.
        deleting = threading.Thread(target=serve.delete, args=(APP_NAME,), daemon=True)
        deleting.start()
        deleting.join(options.drain_timeout_s + 15)
        if deleting.is_alive():
            print("specserve serve: the application did not stop in time", file=sys.stderr)
        ray.shutdown()
    return 0
