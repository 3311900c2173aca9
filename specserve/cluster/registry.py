"""Where the gateway finds its process's request routers (`router.ReplicaSet`), one per
deployment: the engine replicas', and the prefill replicas' when there is a prefill pool.

Ray Serve builds the router inside the deployment handle, from a copy of `router.py` it ships
by value, so the copy's class attributes are not the module's. The router registers itself
here (a module imported normally, so there is one per process) and `ClusterEngine` reads the
live replicas and their reports through it.
"""

from __future__ import annotations

_current: dict[str, object] = {}  # deployment name -> the ReplicaSet this process built last


def register(deployment: str, router) -> None:
    _current[deployment] = router


def current_router(deployment: str):
    """The deployment's router, or None before the first call through its handle built it."""
    return _current.get(deployment)
