"""Fixtures for the browser tests: Debian's chromium under Playwright, and live servers.

Chromium is the distribution's build (`.ci/install_browser.sh`), launched by path; these tests
never download a browser. Without it they skip and say how to get it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from tests.browser.servers import LiveServer

CHROMIUM = Path(os.environ.get("SPECSERVE_CHROMIUM", "/usr/lib/chromium/chromium"))
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
ARTIFACTS = Path(__file__).resolve().parents[2] / "artifacts" / "browser"
VIEWPORT = {"width": 1280, "height": 800}


SKIP_REASON = (f"Debian's chromium is not installed at {CHROMIUM}; "
               f"run .ci/install_browser.sh (as root)")


def pytest_collection_modifyitems(config, items):
    """Skip before any server starts when there is no browser to drive."""
    if CHROMIUM.is_file():
        return
    for item in items:
        if "browser" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(scope="module")
def chromium():
    """Per module, not per session: while the sync Playwright runs, its event loop is current
    on this thread, and `asyncio.run` in any later test (tests/server) would refuse to start."""
    if not CHROMIUM.is_file():
        pytest.skip(SKIP_REASON)
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip("the playwright Python package is not installed")
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def new_page(chromium):
    """Open pages in a fresh context (empty local storage).

    Fails the test on an uncaught page error, or on any request that leaves 127.0.0.1: the
    page must work offline.
    """
    contexts, errors, remote = [], [], []

    def local(url: str) -> bool:
        return url.startswith(("http://127.0.0.1:", "ws://127.0.0.1:", "data:"))

    def open_page(url: str | None = None):
        context = chromium.new_context(viewport=VIEWPORT)
        contexts.append(context)
        page = context.new_page()
        page.set_default_timeout(15_000)
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.on("request", lambda req: None if local(req.url) else remote.append(req.url))
        page.on("websocket", lambda ws: None if local(ws.url) else remote.append(ws.url))
        if url is not None:
            page.goto(url)
        return page

    yield open_page
    for context in contexts:
        with contextlib.suppress(Exception):
            context.close()
    assert not errors, f"uncaught errors in the page: {errors}"
    assert not remote, f"the page reached beyond the server: {remote}"


@pytest.fixture(scope="session")
def artifacts() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS


@pytest.fixture(scope="module", autouse=True)
def _one_torch_thread():
    """One intra-op thread: on a small shared CPU, two threads make the tiny models slower."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def serve(engine, **app_options) -> LiveServer:
    return LiveServer(engine, **app_options).start()
