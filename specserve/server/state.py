"""`ServerState`: what every route needs, built once by `app.create_app` and stored on
`app.state.server`. It lives apart from the app so the route modules (`ws`, `openai_api`,
`tokenize_api`) read its type without importing the app that imports them."""

from __future__ import annotations

from dataclasses import dataclass

from ..engine import AsyncEngine
from .admission import Admission
from .auth import Guard
from .limits import Preparer, ServerLimits
from .metrics import ServerMetrics


@dataclass
class ServerState:
    """What every route needs; stored on `app.state.server`."""

    engine: AsyncEngine
    model_name: str
    model_root: str
    limits: ServerLimits
    guard: Guard
    metrics: ServerMetrics
    created: int
    preparer: Preparer  # validation and tokenizing, off the event loop
    admission: Admission
