// The conversation view: one <article> per message, markdown rendered from the raw text on
// every change (coalesced to one render per animation frame while a reply streams).
//
// A message is the stored object {role, content, draft?, metrics?, status?, error?,
// requestId?}. The view never keeps its own copy of the text: `update(msg)` re-renders from
// the object, so what is on screen is always what is in local storage.

import { render as renderMarkdown } from "./markdown.js";
import { formatStats } from "./stats.js";

const STATUS_TEXT = {
  completed: "",
  incomplete: "stopped at the token limit",
  cancelled: "stopped",
  failed: "failed",
  interrupted: "interrupted: the connection was lost",
};

export class MessagesView {
  constructor(container) {
    this.container = container;
    this.elements = new Map(); // message object -> its <article>
    this.pending = new Set();
    this.frame = null;
    // When the view itself shrinks (a banner appears above it), keep the end in sight if it
    // was: `pinned` is where the reader was at the last scroll.
    this.pinned = true;
    container.addEventListener("scroll", () => {
      this.pinned = this.atBottom();
    });
    new ResizeObserver(() => {
      if (this.pinned) this.scrollToEnd();
    }).observe(container);
  }

  /** Whether the view shows the end of the conversation (so it should keep following it). */
  atBottom() {
    const c = this.container;
    return c.scrollHeight - c.scrollTop - c.clientHeight < 40;
  }

  setShowDraft(on) {
    this.container.classList.toggle("show-draft", on);
  }

  /** Replace the view with `messages`. */
  show(messages) {
    this.elements.clear();
    this.pending.clear();
    const doc = this.container.ownerDocument;
    const nodes = messages.filter((m) => m.role !== "system").map((m) => this.build(m));
    if (nodes.length === 0) {
      const empty = doc.createElement("p");
      empty.className = "empty";
      empty.textContent = "Send a message to start. Accepted draft tokens are highlighted " +
        "as the reply streams in.";
      nodes.push(empty);
    }
    this.container.replaceChildren(...nodes);
    this.scrollToEnd();
  }

  append(msg) {
    this.container.querySelector(".empty")?.remove();
    this.container.appendChild(this.build(msg));
    this.scrollToEnd();
  }

  remove(msg) {
    this.elements.get(msg)?.remove();
    this.elements.delete(msg);
  }

  /** Re-render `msg` on the next animation frame (many deltas per frame become one render). */
  update(msg, { now = false } = {}) {
    if (!this.elements.has(msg)) return;
    this.pending.add(msg);
    if (now) {
      this.flush();
      return;
    }
    if (this.frame === null) {
      // requestAnimationFrame does not run in a hidden tab; the timeout keeps text current there.
      const run = () => this.flush();
      this.frame = requestAnimationFrame(run);
      this.frameTimeout = setTimeout(run, 100);
    }
  }

  flush() {
    cancelAnimationFrame(this.frame);
    clearTimeout(this.frameTimeout);
    this.frame = null;
    // Follow the stream only if the reader was at the end; someone reading further up stays put.
    const follow = this.atBottom();
    for (const msg of this.pending) {
      const article = this.elements.get(msg);
      if (article) this.fill(article, msg);
    }
    this.pending.clear();
    if (follow) this.scrollToEnd();
  }

  scrollToEnd() {
    this.container.scrollTop = this.container.scrollHeight;
    this.pinned = true;
  }

  build(msg) {
    const doc = this.container.ownerDocument;
    const article = doc.createElement("article");
    article.className = "msg";
    article.dataset.role = msg.role;

    const head = doc.createElement("div");
    head.className = "msg-head";
    const role = doc.createElement("span");
    role.className = "role";
    role.textContent = msg.role;
    const actions = doc.createElement("span");
    actions.className = "actions";
    const rawButton = doc.createElement("button");
    rawButton.type = "button";
    rawButton.className = "toggle-raw";
    rawButton.textContent = "Raw";
    rawButton.setAttribute("aria-pressed", "false");
    rawButton.title = "Show the text exactly as received, without markdown";
    rawButton.addEventListener("click", () => {
      const pressed = rawButton.getAttribute("aria-pressed") !== "true";
      rawButton.setAttribute("aria-pressed", String(pressed));
      article.dataset.raw = String(pressed);
      this.fill(article, msg);
    });
    const copyButton = doc.createElement("button");
    copyButton.type = "button";
    copyButton.textContent = "Copy";
    copyButton.addEventListener("click", () => {
      navigator.clipboard?.writeText(msg.content).catch(() => {});
    });
    actions.append(rawButton, copyButton);
    head.append(role, actions);

    const body = doc.createElement("div");
    body.className = "msg-body";
    const foot = doc.createElement("div");
    foot.className = "msg-foot";
    article.append(head, body, foot);
    this.elements.set(msg, article);
    this.fill(article, msg);
    return article;
  }

  fill(article, msg) {
    const doc = article.ownerDocument;
    const streaming = msg.status === "streaming";
    article.dataset.streaming = String(streaming);
    article.setAttribute("aria-busy", String(streaming));
    if (msg.requestId) article.dataset.requestId = msg.requestId;
    if (msg.status) article.dataset.status = msg.status;

    const body = article.querySelector(".msg-body");
    if (article.dataset.raw === "true") {
      const pre = doc.createElement("pre");
      pre.className = "msg-raw";
      pre.textContent = msg.content;
      body.replaceChildren(pre);
    } else if (msg.role === "user") {
      // What the user typed is shown as typed: no markdown, so nothing is lost or reinterpreted.
      const p = doc.createElement("p");
      p.textContent = msg.content;
      body.replaceChildren(p);
    } else {
      renderMarkdown(msg.content, body, msg.draft || []);
    }

    const foot = article.querySelector(".msg-foot");
    foot.dataset.status = msg.status || "";
    foot.textContent = footText(msg);
  }
}

function footText(msg) {
  if (msg.role !== "assistant" || !msg.status || msg.status === "streaming") return "";
  const parts = [];
  const status = msg.reason === "server_shutdown" ? "cancelled: the server shut down"
    : STATUS_TEXT[msg.status] ?? msg.status;
  if (status) parts.push(status);
  if (msg.error) parts.push(msg.error);
  if (msg.metrics && msg.metrics.tokens > 0) {
    const s = formatStats(msg.metrics);
    parts.push(`${s.tokens} tokens`, `${s.tokensPerS} tok/s`, `TTFT ${s.ttft}`,
               `acceptance length ${s.acceptance}`);
  }
  if (msg.speculation) parts.push(`speculation ${msg.speculation}`);
  return parts.join(" · ");
}
