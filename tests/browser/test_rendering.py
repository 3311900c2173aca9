"""Model output is text: HTML in a reply is shown, never run; the markdown subset renders.

The engine here is `ScriptedCore`: the real server and page, and a core whose every reply is
the fixed script below (with made-up accepted-draft counts, so the highlighting shows too).
"""

from __future__ import annotations

import pytest
from playwright.sync_api import expect

from specserve.engine.async_engine import AsyncEngine
from specserve.llm import build_engine_config
from tests.browser.chat_page import ChatPage
from tests.browser.conftest import serve
from tests.browser.servers import ScriptedCore, ScriptedDelta

pytestmark = pytest.mark.browser

SCRIPT = [
    ScriptedDelta("Here is **bold** text, `inline <b>code</b>` and", 9, 7),
    ScriptedDelta(" <script>window.__pwned = 1</script>", 8, 6),
    ScriptedDelta("\n\n- an <img src=x onerror=\"window.__pwned = 2\"> item\n", 9, 8),
    ScriptedDelta("- a second item\n\n```html\n<script>window.__pwned = 3</script>\n", 8, 0),
    ScriptedDelta("```\nDone & <i>dusted</i>.", 5, 3),
]
REPLY = "".join(d.text for d in SCRIPT)


@pytest.fixture(scope="module")
def server(tiny_target):
    core = ScriptedCore(build_engine_config(tiny_target, tiny_target, "chain:3",
                                            num_blocks=64), SCRIPT, step_s=0.1)
    srv = serve(AsyncEngine(core))
    yield srv
    srv.stop()


def test_html_in_model_output_renders_as_text(server, new_page, artifacts):
    chat = ChatPage(new_page(server.url)).wait_connected()
    page = chat.page
    chat.send("Show me some HTML")
    expect(chat.reply()).to_have_attribute("data-streaming", "true")
    page.wait_for_timeout(250)  # a couple of deltas in: the streaming state, for the record
    page.screenshot(path=str(artifacts / "chat_streaming.png"))
    reply = chat.wait_reply_finished()
    expect(reply).to_have_attribute("data-status", "completed")

    # Nothing from the reply became an element or ran.
    messages = page.locator("#messages")
    for tag in ("script", "img", "b", "i"):
        expect(messages.locator(tag)).to_have_count(0)
    assert page.evaluate("window.__pwned") is None
    body = reply.locator(".msg-body")
    expect(body).to_contain_text("<script>window.__pwned = 1</script>")
    expect(body).to_contain_text('<img src=x onerror="window.__pwned = 2">')
    expect(body).to_contain_text("Done & <i>dusted</i>.")
    assert chat.raw_text(reply) == REPLY

    # The markdown subset did render, from text nodes only.
    expect(body.locator("p strong")).to_have_text("bold")
    expect(body.locator("p > code")).to_have_text("inline <b>code</b>")
    expect(body.locator("ul > li")).to_have_count(2)
    expect(body.locator("pre > code")).to_have_text("<script>window.__pwned = 3</script>")
    expect(body.locator("pre > code")).to_have_attribute("data-lang", "html")

    # The first delta's 7 accepted draft tokens of 9 cover most of its text.
    assert body.locator(".tok-draft").count() >= 3
    assert body.locator(".tok-draft").first.text_content().startswith("Here is")
    page.screenshot(path=str(artifacts / "chat.png"))
