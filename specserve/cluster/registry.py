"""Where the gateway finds the engine deployment's request router (`router.ReplicaSet`) of its
process.

Ray Serve builds the router inside the deployment handle, from a copy of `router.py` it ships
by value, so the copy's class attributes are not the module's. The router registers itself
here (a module imported normally, so there is one per process) and `ClusterEngine` reads the
live replicas and their reports through it.
"""

from __future__ import annotations

_current = None  # the ReplicaSet this process built last


def register(router) -> None:
    global _current
    _current = router


def current_router():
    """The router, or None before the first request has built it."""
    return _current
