"""The engine: requests in, token deltas out (see interface.py for what the server may use)."""

from .async_engine import AsyncEngine, EngineStoppedError, RequestStream
from .interface import EngineLimits, EngineStats, KVPoolStats, ModelInfo

__all__ = ["AsyncEngine", "EngineLimits", "EngineStats", "EngineStoppedError", "KVPoolStats",
           "ModelInfo", "RequestStream"]
