// The live numbers under the conversation: tokens/s, TTFT, acceptance length, token count.
// While a reply streams they tick on a timer, so tokens/s moves even between deltas.

import { formatStats } from "./stats.js";

export class LiveView {
  constructor(doc) {
    this.box = doc.getElementById("stats");
    this.fields = {
      tokensPerS: doc.getElementById("stat-tps"),
      ttft: doc.getElementById("stat-ttft"),
      acceptance: doc.getElementById("stat-accept"),
      tokens: doc.getElementById("stat-tokens"),
    };
    this.stats = null;
    this.timer = null;
  }

  /** Follow `stats` (a LiveStats) until `stop()`. */
  follow(stats) {
    this.stats = stats;
    this.box.dataset.active = "true";
    clearInterval(this.timer);
    this.timer = setInterval(() => this.refresh(), 250);
    this.refresh();
  }

  /** Freeze on the final numbers. */
  stop() {
    clearInterval(this.timer);
    this.timer = null;
    this.box.dataset.active = "false";
    this.refresh();
  }

  refresh() {
    if (!this.stats) return;
    const text = formatStats(this.stats.snapshot());
    for (const [name, el] of Object.entries(this.fields)) el.textContent = text[name];
  }
}
