"""A real uvicorn serving the tiny target with itself as the draft (`chain:3`), per module.

The same setup as the server tests (tests/server/server_helpers.py): every greedy draft token is
accepted, so deltas carry several tokens and the acceptance length is above 1.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.server_helpers import SPEC, start_server


@pytest.fixture(scope="module")
def server(tiny_target: Path):
    srv = start_server(tiny_target, tiny_target, SPEC)
    yield srv
    srv.stop()


@pytest.fixture(autouse=True)
def _no_leak(request):
    """After each test that used the server: it is idle with every KV block free."""
    yield
    if "server" in request.fixturenames:
        request.getfixturevalue("server").wait_idle()
