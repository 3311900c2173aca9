// Live numbers for one streaming reply, computed from the deltas as they arrive, and replaced
// by the server's own metrics when `response.done` comes.
//
// Acceptance length (tokens per target forward while decoding, as the server defines it) is
// exact from the deltas alone: every target forward commits exactly one token that is not an
// accepted draft token (the bonus or recovered token), so forwards = tokens - accepted draft
// tokens. The first delta comes from the forward that finished the prompt and is left out,
// like the server does.

export class LiveStats {
  constructor(now = performance.now()) {
    this.sentAt = now;
    this.firstAt = null;
    this.lastAt = null;
    this.tokens = 0;
    this.decodeTokens = 0;
    this.decodeDraft = 0;
    this.final = null; // the server's metrics once the reply is done
  }

  addDelta(nTokens, nDraftAccepted, now = performance.now()) {
    if (nTokens <= 0) return;
    this.lastAt = now;
    this.tokens += nTokens;
    if (this.firstAt === null) {
      this.firstAt = now;
      return;
    }
    this.decodeTokens += nTokens;
    this.decodeDraft += Math.min(nDraftAccepted || 0, nTokens);
  }

  finish(metrics, usage) {
    this.final = { ...(metrics || {}) };
    if (usage && usage.output_tokens !== undefined) this.final.output_tokens = usage.output_tokens;
  }

  /** {ttftMs, tokensPerS, acceptanceLength, tokens}; a field is null while unknown. */
  snapshot(now = performance.now()) {
    const f = this.final || {};
    const ttftMs = f.ttft_ms ?? (this.firstAt === null ? null : this.firstAt - this.sentAt);
    // Decode rate after the first token, so a long prompt does not drag the number down; the
    // time to the first token is shown on its own.
    let tokensPerS = f.tokens_per_s ?? null;
    if (tokensPerS === null && this.firstAt !== null) {
      const end = this.final ? this.lastAt : now;
      const seconds = (end - this.firstAt) / 1000;
      tokensPerS = seconds > 0 && this.decodeTokens > 0 ? this.decodeTokens / seconds : null;
    }
    const forwards = this.decodeTokens - this.decodeDraft;
    const acceptanceLength = f.acceptance_length ??
      (forwards > 0 ? this.decodeTokens / forwards : null);
    return {
      ttftMs,
      tokensPerS,
      acceptanceLength,
      tokens: f.output_tokens ?? this.tokens,
    };
  }
}

export function formatStats(s) {
  const dash = "–";
  return {
    tokensPerS: s.tokensPerS === null ? dash : s.tokensPerS.toFixed(1),
    ttft: s.ttftMs === null ? dash : `${Math.round(s.ttftMs)} ms`,
    acceptance: s.acceptanceLength === null ? dash : s.acceptanceLength.toFixed(2),
    tokens: String(s.tokens),
  };
}
