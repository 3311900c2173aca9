"""The HTTP/WebSocket server: starlette app, `specserve.v1` sessions, OpenAI routes, metrics."""

from .app import create_app, uvicorn_config
from .limits import ServerLimits

__all__ = ["ServerLimits", "create_app", "uvicorn_config"]
