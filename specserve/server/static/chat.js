// The chat controller: turns user actions into protocol events (response.create / .cancel)
// and server events into changes of the stored conversation, which the views then show.
//
// One reply streams at a time. Its message object is in the conversation from the start
// (status "streaming"), so switching conversations or reloading never loses what arrived.

import { Reply } from "./reply.js";
import { newId } from "./store.js";

export class ChatController extends EventTarget {
  constructor({ connection, store, settings, view, live, status }) {
    super();
    this.connection = connection;
    this.store = store;
    this.settings = settings;
    this.view = view;
    this.live = live;
    this.status = status;
    this.conversation = null;
    this.active = null; // {conv, msg, reply, stopping}
  }

  get busy() {
    return this.active !== null;
  }

  get stopping() {
    return this.active?.stopping ?? false;
  }

  get canRegenerate() {
    const last = this.conversation?.messages.at(-1);
    return !this.busy && last?.role === "assistant";
  }

  open(conv) {
    this.conversation = conv;
    this.view.show(conv.messages);
    this.changed();
  }

  /** Send `text` as the next user message; false if it cannot be sent now. */
  send(text) {
    if (this.busy || !text.trim() || this.connection.state !== "open") return false;
    const conv = this.conversation;
    const msg = { role: "user", content: text };
    conv.messages.push(msg);
    this.store.touch(conv);
    this.view.append(msg);
    this.start(conv);
    return true;
  }

  /** Replace the last reply with a new one for the same history. */
  regenerate() {
    if (!this.canRegenerate || this.connection.state !== "open") return false;
    const conv = this.conversation;
    this.view.remove(conv.messages.pop());
    this.start(conv);
    return true;
  }

  stop() {
    const active = this.active;
    if (!active || active.stopping) return;
    active.stopping = true;
    if (!this.connection.send({ type: "response.cancel", request_id: active.reply.requestId })) {
      this.finish({ status: "cancelled", reason: "client_cancelled" });
      return;
    }
    this.changed();
  }

  start(conv) {
    const requestId = `r-${newId()}`;
    const request = {
      type: "response.create",
      request_id: requestId,
      response: this.buildResponse(conv.messages),
    };
    const reply = new Reply(requestId);
    const msg = { role: "assistant", content: "", status: "streaming", requestId, draft: [] };
    conv.messages.push(msg);
    this.active = { conv, msg, reply, stopping: false };
    this.view.append(msg);
    this.live.follow(reply.stats);
    this.status.hide();
    if (!this.connection.send(request)) {
      this.fail("not connected to the server");
      return;
    }
    this.changed();
  }

  buildResponse(history) {
    const s = this.settings;
    const messages = [];
    if (s.systemPrompt.trim()) messages.push({ role: "system", content: s.systemPrompt });
    for (const m of history) {
      // A reply that failed before any text carries nothing the model should see.
      if (m.role === "assistant" && !m.content) continue;
      messages.push({ role: m.role, content: m.content });
    }
    const response = { messages, temperature: s.temperature, top_p: s.topP };
    if (s.maxTokens !== null) {
      const limit = this.connection.session?.limits?.max_output_tokens;
      response.max_output_tokens = limit ? Math.min(s.maxTokens, limit) : s.maxTokens;
    }
    // Speculation on: the server's own mode. Off: plain target decoding, to compare speeds.
    if (!s.speculation) response.speculation = "off";
    return response;
  }

  /** Route one server event (from Connection's "message"). */
  handle(event) {
    const active = this.active;
    const mine = active && event.request_id === active.reply.requestId;
    switch (event.type) {
      case "response.output_text.delta":
        if (mine && active.reply.addDelta(event)) {
          active.msg.content = active.reply.text;
          active.msg.draft = active.reply.marks;
          this.view.update(active.msg);
          this.live.refresh();
        }
        break;
      case "response.created":
        // The mode that actually runs (the server's default when speculation is on).
        if (mine) active.msg.speculation = event.response?.speculation;
        break;
      case "response.done":
        if (mine) this.finish(event);
        break;
      case "error":
        this.onError(event, mine);
        break;
      default:
        break; // session.created, pong: nothing to show
    }
  }

  onError(event, mine) {
    // A cancel that crossed the reply's own "done" on the wire is harmless.
    if (event.code === "unknown_request_id") return;
    const message = `${event.message || "server error"}${event.code ? ` (${event.code})` : ""}`;
    if (mine) this.fail(message); // an error about a request means it never started
    else this.status.error(message);
  }

  /** The socket closed under a streaming reply: the server has cancelled it. */
  connectionLost() {
    if (!this.active) return;
    this.finish({ status: "interrupted" });
  }

  fail(message) {
    this.finish({ status: "failed", error: { message } });
    this.status.error(message);
  }

  finish(done) {
    const { conv, msg, reply } = this.active;
    reply.finish(done);
    msg.status = reply.status;
    if (reply.reason) msg.reason = reply.reason;
    if (done.error?.message) msg.error = done.error.message;
    msg.content = reply.text;
    msg.draft = reply.marks;
    msg.metrics = reply.stats.snapshot();
    this.active = null;
    this.store.touch(conv);
    this.view.update(msg, { now: true });
    this.live.stop();
    this.changed();
  }

  changed() {
    this.dispatchEvent(new Event("change"));
  }
}
