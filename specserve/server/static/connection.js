// The WebSocket to /v1/ws: connect, reconnect with back-off, offer the API key, route events.
//
// The page only ever talks to the server that served it, so the URL comes from
// `location`. The key travels as a second offered subprotocol ("bearer.<key>") because a
// browser cannot set an Authorization header on a WebSocket.
//
// Events (EventTarget): "state" {state, reason, retryIn} and "message" {event}.
// States: "connecting" | "open" | "disconnected" | "unauthorized".

export const PROTOCOL = "specserve.v1";
const BACKOFF_MS = [500, 1000, 2000, 4000, 8000, 15000];
const PING_EVERY_MS = 20000;

export function socketUrl(loc = window.location) {
  const scheme = loc.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${loc.host}/v1/ws`;
}

export class Connection extends EventTarget {
  constructor({ url = socketUrl(), apiKey = "" } = {}) {
    super();
    this.url = url;
    this.apiKey = apiKey;
    this.state = "disconnected";
    this.socket = null;
    this.attempt = 0;
    this.retryTimer = null;
    this.pingTimer = null;
    this.session = null;
    this.opened = false; // whether the current socket ever opened
  }

  setApiKey(key) {
    this.apiKey = key;
  }

  connect() {
    clearTimeout(this.retryTimer);
    this.retryTimer = null;
    this.dropSocket();
    this.opened = false;
    this.session = null;
    this.setState("connecting");
    const protocols = [PROTOCOL];
    if (this.apiKey) protocols.push(`bearer.${this.apiKey}`);
    let socket;
    try {
      socket = new WebSocket(this.url, protocols);
    } catch (err) {
      this.scheduleRetry(String(err));
      return;
    }
    this.socket = socket;
    socket.addEventListener("open", () => {
      if (socket !== this.socket) return;
      this.opened = true;
      this.attempt = 0;
      this.pingTimer = setInterval(() => this.send({ type: "ping" }), PING_EVERY_MS);
      // "open" is announced on session.created, when the server has accepted us.
    });
    socket.addEventListener("message", (msg) => {
      if (socket !== this.socket) return;
      let event;
      try {
        event = JSON.parse(msg.data);
      } catch {
        return; // the protocol is JSON text frames; anything else is not for us
      }
      if (event.type === "session.created") {
        this.session = event.session || {};
        this.setState("open");
      }
      this.dispatchEvent(new CustomEvent("message", { detail: { event } }));
    });
    socket.addEventListener("close", (ev) => {
      if (socket !== this.socket) return;
      this.dropSocket();
      this.onClose(ev);
    });
  }

  onClose(ev) {
    if (isAuthClose(ev)) {
      this.setState("unauthorized", ev.reason || "an API key is required");
      return;
    }
    const reason = ev.reason || (this.opened ? "connection lost" : "server unreachable");
    this.scheduleRetry(reason);
  }

  scheduleRetry(reason) {
    const delay = BACKOFF_MS[Math.min(this.attempt, BACKOFF_MS.length - 1)];
    this.attempt += 1;
    this.retryTimer = setTimeout(() => this.connect(), delay);
    this.setState("disconnected", reason, delay);
  }

  /** Reconnect now (the "Retry" button), skipping the back-off wait. */
  retryNow() {
    this.attempt = 0;
    this.connect();
  }

  /** Send one client event; false when the socket is not open. */
  send(event) {
    if (!this.socket || this.socket.readyState !== WebSocket.OPEN) return false;
    this.socket.send(JSON.stringify(event));
    return true;
  }

  dropSocket() {
    clearInterval(this.pingTimer);
    this.pingTimer = null;
    const socket = this.socket;
    this.socket = null;
    if (socket && socket.readyState <= WebSocket.OPEN) socket.close(1000);
  }

  setState(state, reason = "", retryIn = 0) {
    this.state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: { state, reason, retryIn } }));
  }
}

// The server closes with 4401 (missing/invalid key) or policy-violation 1008 carrying an
// "auth"/"key" reason when it needs an API key.
function isAuthClose(ev) {
  if (ev.code === 4401 || ev.code === 4403) return true;
  return ev.code === 1008 && /key|auth|unauthori[sz]ed/i.test(ev.reason || "");
}
