"""`specserve serve --replicas N [--ray-address ADDR]`: start or join a Ray cluster, run the
engine replicas on it, and serve the gateway from this process until SIGTERM/SIGINT.

Without ADDR, `ray.init()` joins the Ray cluster this machine is part of (`RAY_ADDRESS`, or
the one `ray start` last started here) or starts a local one. The gateway (`gateway.py`)
listens on --host/--port of this machine; Serve's own HTTP proxy is not started. On a signal
the gateway drains as one server does, then the application is deleted (Serve lets each
replica finish first); a local cluster this process started goes with it, a joined one keeps
running.
"""

from __future__ import annotations

import signal
import sys
import threading

APP_NAME = "specserve"


def serve_forever(options, host: str, port: int, ray_address: str | None,
                  log_level: str = "info") -> int:
    import ray
    from ray import serve

    from .app import build_application
    from .gateway import gateway_server

    application = build_application(options)  # bad options fail before Ray starts

    def interrupt(*_) -> None:  # until the gateway serves (it then drains on a signal)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    context = ray.init(address=ray_address, include_dashboard=False)
    try:
        serve.start(proxy_location="Disabled")
        try:
            serve.run(application, name=APP_NAME, route_prefix=None)
        except RuntimeError as exc:  # a replica failed to start (Ray logged why above)
            print(f"specserve serve: the application did not start: {exc}", file=sys.stderr)
            return 1
        server = gateway_server(APP_NAME, options, host, port, log_level)
        print(f"specserve: {options.num_replicas} engine replica(s) behind the gateway on "
              f"http://{host}:{port} (Ray cluster {context.address_info['address']})",
              file=sys.stderr, flush=True)
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # the deletion below is bounded anyway
            signal.signal(sig, signal.SIG_IGN)
        # Serve drains each replica (its graceful shutdown timeout) before deleting it. Bounded:
        # a signal sent to the whole process group may have ended Ray's own processes too.
        deleting = threading.Thread(target=serve.delete, args=(APP_NAME,), daemon=True)
        deleting.start()
        deleting.join(options.drain_timeout_s + 15)
        if deleting.is_alive():
            print("specserve serve: the application did not stop in time", file=sys.stderr)
        ray.shutdown()
    return 0
