"""A page object for the chat page: what a user does, in the words of the tests."""

from __future__ import annotations

import json

FINISHED = ("completed", "incomplete", "cancelled", "failed", "interrupted")


class ChatPage:
    def __init__(self, page) -> None:
        self.page = page

    def wait_connected(self) -> ChatPage:
        self.page.wait_for_selector('#conn-status[data-state="open"]')
        return self

    def set_sampling(self, *, greedy: bool = True, max_tokens: int | None = None) -> None:
        """Through the settings panel, as a user would (Home moves a range input to its min)."""
        page = self.page
        page.click("#settings-toggle")
        if greedy:
            page.focus("#temperature")
            page.keyboard.press("Home")
            assert page.input_value("#temperature") == "0"
        if max_tokens is not None:
            page.fill("#max-tokens", str(max_tokens))
        page.click("#settings-toggle")

    def type_message(self, text: str) -> None:
        """Type into the message box; newlines are typed as Shift+Enter."""
        box = self.page.locator("#prompt")
        box.click()
        for k, line in enumerate(text.split("\n")):
            if k:
                box.press("Shift+Enter")
            if len(line) <= 40:
                box.press_sequentially(line)
            else:  # long text: one input event instead of a key press per character
                self.page.keyboard.insert_text(line)

    def send(self, text: str) -> None:
        self.type_message(text)
        self.page.locator("#prompt").press("Enter")

    def reply(self, index: int = -1):
        replies = self.page.locator('article[data-role="assistant"]')
        return replies.nth(index) if index >= 0 else replies.last

    def wait_reply_finished(self, timeout: float = 30_000):
        selector = ", ".join(f'article[data-role="assistant"][data-status="{s}"]'
                             for s in FINISHED)
        self.page.wait_for_selector(selector, timeout=timeout)
        return self.reply()

    def rendered_text(self, reply) -> str:
        return reply.locator(".msg-body").text_content()

    def raw_text(self, reply) -> str:
        """The reply exactly as received, from the message's "Raw" view."""
        button = reply.locator(".toggle-raw")
        button.click()
        text = reply.locator(".msg-raw").text_content()
        button.click()
        return text

    def stored_conversations(self) -> list[dict]:
        raw = self.page.evaluate("localStorage.getItem('specserve.conversations.v1')")
        return json.loads(raw) if raw else []
