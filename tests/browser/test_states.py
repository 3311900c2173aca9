"""The page's states: disconnected with retry, the API key prompt, and server errors.

Each test runs its own server (the real app over a `ScriptedCore`, which answers "ok"), so it
can stop it, bring it back on the same port, or require a key.
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from specserve.engine.async_engine import AsyncEngine
from specserve.llm import build_engine_config
from tests.browser.chat_page import ChatPage
from tests.browser.servers import LiveServer, ScriptedCore, ScriptedDelta

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def core(tiny_target):
    """One core for the module's servers; they run one after another."""
    return ScriptedCore(build_engine_config(tiny_target, tiny_target, "chain:3", num_blocks=64),
                        [ScriptedDelta("o", 1), ScriptedDelta("k", 1, 0)])


def test_disconnected_then_retry(core, new_page, artifacts):
    # A reply long enough to still be streaming when the server goes away.
    slow = ScriptedCore(core.config, [ScriptedDelta("tick ", 1)] * 200, step_s=0.05)
    server = LiveServer(AsyncEngine(slow)).start()
    page = new_page()
    # A controllable clock: the back-off's own timer must not reconnect first (on a loaded
    # machine it did, and the banner with its button was gone before the click).
    page.clock.install()
    page.goto(server.url)
    chat = ChatPage(page).wait_connected()
    chat.send("count")
    expect(chat.reply().locator(".msg-body")).to_contain_text("tick tick")
    server.stop()

    # The reply ends as cut off (the socket closed under it, or the server said it shut down).
    reply = chat.wait_reply_finished()
    assert reply.get_attribute("data-status") in ("interrupted", "cancelled")
    expect(page.locator("#send")).to_be_visible()

    # The socket went away: the page says so, counts down to its next try, and offers one now.
    status = page.locator("#conn-status")
    expect(status).not_to_have_attribute("data-state", "open")
    expect(page.locator("#banner")).to_be_visible()
    expect(page.locator("#banner-text")).to_contain_text("Disconnected")
    expect(page.locator("#retry")).to_be_visible()
    expect(page.locator("#send")).to_be_disabled()
    page.screenshot(path=str(artifacts / "disconnected.png"))

    # Stop the page's timers (a jump of 1 s fires the due ones while the server is still down),
    # so only "Retry now" can reconnect.
    page.clock.pause_at(page.evaluate("Date.now()") + 1000)
    expect(page.locator("#retry")).to_be_visible()

    # Back on the same port; "Retry now" reconnects without waiting out the back-off.
    server = LiveServer(AsyncEngine(core), port=server.port).start()
    try:
        page.click("#retry")
        expect(status).to_have_attribute("data-state", "open")
        expect(page.locator("#banner")).to_be_hidden()
        page.clock.resume()
        page.click("#new-chat")
        chat.send("still there?")
        expect(chat.wait_reply_finished()).to_have_attribute("data-status", "completed")
        assert chat.raw_text(chat.reply()) == "ok"
    finally:
        server.stop()


def test_api_key_prompt(core, new_page, artifacts):
    server = LiveServer(AsyncEngine(core), api_key="open-sesame").start()
    try:
        # /health says a key is needed: the page asks before it connects.
        page = new_page(server.url)
        dialog = page.locator("#api-key-dialog")
        expect(dialog).to_be_visible()
        expect(page.locator("#conn-status")).to_have_attribute("data-state", "unauthorized")
        page.screenshot(path=str(artifacts / "api_key.png"))

        # A wrong key: the server closes with 4401 and the page asks again.
        page.fill("#api-key", "wrong")
        page.locator("#api-key-form button[value=ok]").click()
        expect(dialog).to_be_visible()
        expect(page.locator("#banner-text")).to_contain_text("API key")

        page.fill("#api-key", "open-sesame")
        page.locator("#api-key-form button[value=ok]").click()
        chat = ChatPage(page).wait_connected()
        expect(dialog).to_be_hidden()
        chat.send("hello")
        assert chat.raw_text(chat.wait_reply_finished()) == "ok"

        # The key is remembered: a reload connects straight away.
        page.reload()
        chat.wait_connected()
        expect(dialog).to_be_hidden()
    finally:
        server.stop()


def test_server_error_is_shown_and_the_chat_goes_on(core, new_page, artifacts):
    server = LiveServer(AsyncEngine(core)).start()
    try:
        chat = ChatPage(new_page(server.url)).wait_connected()
        page = chat.page
        # Far more than the tiny model's 512-token context: the server refuses the request.
        chat.send("x " * 1200)
        reply = chat.wait_reply_finished()
        expect(reply).to_have_attribute("data-status", "failed")
        expect(page.locator("#banner")).to_have_attribute("data-kind", "error")
        expect(page.locator("#banner-text")).to_contain_text("prompt_too_long")
        expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")
        page.screenshot(path=str(artifacts / "server_error.png"))

        page.click("#banner-close")
        expect(page.locator("#banner")).to_be_hidden()
        page.click("#new-chat")
        chat.send("short")
        expect(chat.wait_reply_finished()).to_have_attribute("data-status", "completed")
    finally:
        server.stop()
