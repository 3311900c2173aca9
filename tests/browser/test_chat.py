"""The chat page over the real server and the real engine (tiny models, greedy).

The tiny target drafts for itself here: every greedy draft token is accepted, so deltas carry
several tokens and the draft highlighting is driven by the engine's real `n_draft_accepted`
(a random draft would almost never be accepted and leave nothing to see). The engine is paced
to one step per 50 ms so a reply is slow enough to watch stream and to stop halfway.
"""

from __future__ import annotations

import re
import time

import pytest
from playwright.sync_api import expect

from specserve.llm import LLM, build_engine_config
from specserve.sampling import SamplingParams
from tests.browser.chat_page import ChatPage
from tests.browser.conftest import serve
from tests.browser.servers import PacedCore, RecordingEngine

pytestmark = pytest.mark.browser

SPEC = "chain:3"
STEP_S = 0.05


@pytest.fixture(scope="module")
def server(tiny_target):
    core = PacedCore(build_engine_config(tiny_target, tiny_target, SPEC, num_blocks=64), STEP_S)
    srv = serve(RecordingEngine(core))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def reference(tiny_target) -> LLM:
    """Target-only greedy decoding: what the page must show, token for token."""
    return LLM(tiny_target)


@pytest.fixture(autouse=True)
def _engine_idle_after(server):
    yield
    server.wait_idle()


def expected_reply(reference: LLM, user_text: str, max_tokens: int, system: str | None = None):
    messages = [{"role": "system", "content": system}] if system else []
    messages.append({"role": "user", "content": user_text})
    ids = reference.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
    return reference.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens))[0]


def squash(text: str) -> str:
    """Markdown rendering may regroup whitespace (paragraph breaks); the characters stay."""
    return re.sub(r"\s+", "", text)


RECORD_LENGTHS = """() => {
  // Every length the streaming reply's rendered text goes through.
  window.__lengths = [];
  new MutationObserver(() => {
    const body = [...document.querySelectorAll('article[data-role="assistant"] .msg-body')].at(-1);
    if (body) window.__lengths.push(body.textContent.length);
  }).observe(document.getElementById("messages"),
             {childList: true, subtree: true, characterData: true});
}"""


def test_reply_streams_in_and_matches_the_engine(server, reference, new_page, artifacts):
    chat = ChatPage(new_page(server.url)).wait_connected()
    page = chat.page
    # The public contract: one <textarea>, the message box.
    expect(page.locator("textarea")).to_have_count(1)
    expect(page.locator("textarea")).to_have_attribute("id", "prompt")
    chat.set_sampling(greedy=True, max_tokens=48)

    # Shift+Enter makes a new line and sends nothing; Enter sends.
    chat.type_message("Hello there\nwho are you?")
    assert page.input_value("#prompt") == "Hello there\nwho are you?"
    expect(page.locator("article")).to_have_count(0)
    page.evaluate(RECORD_LENGTHS)
    page.locator("#prompt").press("Enter")
    expect(page.locator("#prompt")).to_have_value("")

    reply = chat.reply()
    expect(reply).to_have_attribute("data-streaming", "true")
    expect(page.locator("#stop")).to_be_visible()
    expect(page.locator("#stats")).to_have_attribute("data-active", "true")
    reply = chat.wait_reply_finished()
    expect(page.locator("#send")).to_be_visible()

    want = expected_reply(reference, "Hello there\nwho are you?", 48)
    assert chat.raw_text(reply) == want.text
    assert squash(chat.rendered_text(reply)) == squash(want.text)
    status = {"length": "incomplete", "stop": "completed"}[want.finish_reason]
    expect(reply).to_have_attribute("data-status", status)

    # It streamed: the text grew through several lengths, not all at once.
    lengths = page.evaluate("window.__lengths")
    assert len({n for n in lengths if 0 < n < len(chat.rendered_text(reply))}) >= 3, lengths

    # Speculation is visible: draft-accepted text is marked, the live numbers are filled in.
    assert reply.locator(".tok-draft").count() > 0
    assert float(page.text_content("#stat-accept")) > 1.0
    assert float(page.text_content("#stat-tps")) > 0
    assert page.text_content("#stat-ttft").endswith(" ms")
    assert page.text_content("#stat-tokens") == str(len(want.token_ids))
    expect(reply.locator(".msg-foot")).to_contain_text("acceptance length")

    # The toggle hides the marking without touching the text.
    draft_bg = "window.getComputedStyle(document.querySelector('.tok-draft')).backgroundColor"
    assert page.evaluate(draft_bg) != "rgba(0, 0, 0, 0)"
    page.click("#show-draft")
    assert page.evaluate(draft_bg) == "rgba(0, 0, 0, 0)"
    page.click("#show-draft")

    # The conversation is in local storage, text and all.
    [conv] = chat.stored_conversations()
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"]
    assert conv["messages"][1]["content"] == want.text
    page.screenshot(path=str(artifacts / "chat_engine.png"))


def test_stop_cancels_the_request_on_the_server(server, reference, new_page):
    chat = ChatPage(new_page(server.url)).wait_connected()
    page = chat.page
    chat.set_sampling(greedy=True, max_tokens=400)
    chat.send("Say something long")
    page.wait_for_function("""() => {
      const body = [...document.querySelectorAll('article[data-role="assistant"] .msg-body')]
        .at(-1);
      return body && body.textContent.length > 10;
    }""")
    page.click("#stop")
    reply = chat.wait_reply_finished()
    expect(reply).to_have_attribute("data-status", "cancelled")
    expect(reply.locator(".msg-foot")).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_visible()

    # The server got the cancel: the engine aborted this request and holds nothing any more.
    request_id = reply.get_attribute("data-request-id")
    assert any(rid.endswith("/" + request_id) for rid in server.engine.aborted)
    server.wait_idle(timeout=5)

    # Nothing arrives after the stop, and what did arrive is the engine's first n tokens.
    text = chat.raw_text(reply)
    time.sleep(0.3)
    assert chat.raw_text(reply) == text
    n_tokens = chat.stored_conversations()[0]["messages"][1]["metrics"]["tokens"]
    assert 0 < n_tokens < 400
    assert text == expected_reply(reference, "Say something long", n_tokens).text
    expect(page.locator("#conn-status")).to_have_attribute("data-state", "open")


def test_regenerate_new_chat_and_local_storage(server, new_page):
    chat = ChatPage(new_page(server.url)).wait_connected()
    page = chat.page
    chat.set_sampling(greedy=True, max_tokens=8)
    chat.send("hi")
    first = chat.raw_text(chat.wait_reply_finished())

    page.click("#regenerate")
    expect(chat.reply()).to_have_attribute("data-streaming", "true")
    reply = chat.wait_reply_finished()
    expect(page.locator('article[data-role="assistant"]')).to_have_count(1)
    assert chat.raw_text(reply) == first  # greedy: the same reply again

    # A reload brings back the conversation and the settings from local storage.
    page.reload()
    chat.wait_connected()
    expect(page.locator("article")).to_have_count(2)
    assert chat.raw_text(chat.reply()) == first
    expect(page.locator(".conversation-list li")).to_have_count(1)
    expect(page.locator(".conversation-list .open-conv")).to_have_text("hi")
    assert page.input_value("#temperature") == "0"

    page.click("#new-chat")
    expect(page.locator("article")).to_have_count(0)
    expect(page.locator(".conversation-list li")).to_have_count(2)
    page.locator(".conversation-list .open-conv", has_text="hi").click()
    expect(page.locator("article")).to_have_count(2)


def test_system_prompt_and_speculation_off(server, reference, new_page):
    chat = ChatPage(new_page(server.url)).wait_connected()
    page = chat.page
    chat.set_sampling(greedy=True, max_tokens=12)
    page.click("#settings-toggle")
    page.locator("#system-prompt").fill("Be brief.")
    page.uncheck("#speculation")
    page.click("#settings-toggle")
    chat.send("hi")
    reply = chat.wait_reply_finished()
    # Target-only decoding: nothing to mark, one token per forward, and the system prompt
    # reached the chat template.
    assert reply.locator(".tok-draft").count() == 0
    assert page.text_content("#stat-accept") == "1.00"
    expect(reply.locator(".msg-foot")).to_contain_text("speculation off")
    assert chat.raw_text(reply) == expected_reply(reference, "hi", 12, system="Be brief.").text
