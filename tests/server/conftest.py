"""A real uvicorn on 127.0.0.1 (port chosen by the OS) in a background thread, per test module.

The main server runs the tiny target with itself as the draft (`chain:3`): every greedy draft
token is accepted, so deltas carry several tokens and the speculation fields are non-trivial.
After every test the engine must go idle with every KV block back in the pool.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from server_helpers import NUM_BLOCKS, SPEC, start_server

from specserve.llm import LLM


@pytest.fixture(scope="module")
def server(tiny_target: Path):
    srv = start_server(tiny_target, tiny_target, SPEC)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_target: Path) -> LLM:
    """The offline API with the server's exact configuration: what streams must reproduce."""
    return LLM(tiny_target, draft=tiny_target, speculation=SPEC, num_blocks=NUM_BLOCKS)


@pytest.fixture(autouse=True)
def _no_leak(request):
    """After each test: every server this test used is idle with all KV blocks free."""
    yield
    for name in ("server", "auth_server"):
        if name in request.fixturenames:
            request.getfixturevalue(name).wait_idle()


