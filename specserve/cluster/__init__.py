"""Past one machine: engine replicas behind a prefix-aware router, as a Ray Serve application
(`specserve serve --replicas N`). Needs the `cluster` extra (`ray[serve]`)."""

from .app import ClusterOptions, build_application

__all__ = ["ClusterOptions", "build_application"]
