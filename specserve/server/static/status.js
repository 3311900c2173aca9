// Connection state in the top bar, and the banner under it for what needs the user's eye:
// disconnected (with a countdown and "Retry now"), an API key to enter, or a server error.

const PILL_TEXT = {
  connecting: "Connecting…",
  open: "Connected",
  disconnected: "Disconnected",
  unauthorized: "API key needed",
};

export class StatusView {
  constructor(doc, { onRetry, onEnterKey }) {
    this.pill = doc.getElementById("conn-status");
    this.banner = doc.getElementById("banner");
    this.text = doc.getElementById("banner-text");
    this.retry = doc.getElementById("retry");
    this.enterKey = doc.getElementById("enter-key");
    this.close = doc.getElementById("banner-close");
    this.countdown = null;
    this.retry.addEventListener("click", onRetry);
    this.enterKey.addEventListener("click", onEnterKey);
    this.close.addEventListener("click", () => this.hide());
  }

  /** Follow the connection's state ({state, reason, retryIn} from Connection). */
  setConnection({ state, reason, retryIn }) {
    this.pill.dataset.state = state;
    this.pill.textContent = PILL_TEXT[state] ?? state;
    clearInterval(this.countdown);
    if (state === "open") {
      if (this.banner.dataset.kind !== "error") this.hide();
    } else if (state === "disconnected") {
      const until = Date.now() + retryIn;
      const tick = () => {
        const s = Math.max(0, Math.ceil((until - Date.now()) / 1000));
        this.show("warn", `Disconnected from the server (${reason}). Retrying in ${s} s.`,
                  { retry: true });
      };
      tick();
      this.countdown = setInterval(tick, 500);
    } else if (state === "unauthorized") {
      this.show("warn", `The server needs an API key (${reason}).`, { enterKey: true });
    } else if (state === "connecting" && this.banner.dataset.kind === "warn") {
      this.show("warn", "Reconnecting…");
    }
  }

  /** A server or request error: stays until dismissed or replaced. */
  error(message) {
    this.show("error", message, { dismiss: true });
  }

  show(kind, message, { retry = false, enterKey = false, dismiss = false } = {}) {
    this.banner.dataset.kind = kind;
    this.text.textContent = message;
    this.retry.hidden = !retry;
    this.enterKey.hidden = !enterKey;
    this.close.hidden = !dismiss;
    this.banner.hidden = false;
  }

  hide() {
    this.banner.hidden = true;
    delete this.banner.dataset.kind;
  }
}
