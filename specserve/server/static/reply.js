// One assistant reply as it streams: its text, which characters came from accepted draft
// tokens, and its live stats. No DOM here, so the bookkeeping is easy to reason about.

import { LiveStats } from "./stats.js";

/**
 * How many leading characters of a delta's text came from accepted draft tokens.
 *
 * A step commits its accepted draft tokens first and the target's own (bonus or recovered)
 * token last, so the draft part is a prefix. The server may say exactly how many characters
 * that prefix has (`draft_chars`); otherwise we split the text in proportion to the token
 * counts, which is exact for one-character tokens and close for the rest.
 */
export function draftPrefixLength(delta) {
  const text = delta.delta || "";
  if (Number.isInteger(delta.draft_chars)) return Math.min(delta.draft_chars, text.length);
  const n = delta.n_tokens || 0;
  const a = Math.min(delta.n_draft_accepted || 0, n);
  if (a <= 0 || n <= 0) return 0;
  return Math.round((text.length * a) / n);
}

export class Reply {
  constructor(requestId, now = performance.now()) {
    this.requestId = requestId;
    this.text = "";
    this.marks = []; // sorted, non-overlapping [start, end) ranges of draft-accepted text
    this.stats = new LiveStats(now);
    this.status = "streaming"; // then the server's status: "completed" | "cancelled" | ...
    this.reason = null;
    this.error = null;
    this.lastSeq = -1;
  }

  get streaming() {
    return this.status === "streaming";
  }

  /** Apply one `response.output_text.delta`; a repeated or out-of-date seq is ignored. */
  addDelta(delta, now = performance.now()) {
    if (Number.isInteger(delta.seq)) {
      if (delta.seq <= this.lastSeq) return false;
      this.lastSeq = delta.seq;
    }
    const text = delta.delta || "";
    const draft = draftPrefixLength(delta);
    if (draft > 0) this.addMark(this.text.length, this.text.length + draft);
    this.text += text;
    this.stats.addDelta(delta.n_tokens || 0, delta.n_draft_accepted || 0, now);
    return true;
  }

  addMark(start, end) {
    const last = this.marks.at(-1);
    if (last && last[1] === start) last[1] = end; // keep runs of draft text in one span
    else this.marks.push([start, end]);
  }

  finish(done) {
    this.status = done.status || "completed";
    this.reason = done.reason ?? null;
    this.stats.finish(done.metrics, done.usage);
  }

  fail(message) {
    this.status = "failed";
    this.error = message;
  }
}
