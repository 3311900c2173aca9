// Conversations and settings kept in the browser's local storage; nothing is sent anywhere.
//
// A conversation is {id, title, updated, messages: [{role, content, draft?, metrics?, status?}]}.
// `draft` holds the [start, end) ranges of an assistant reply that arrived through accepted draft
// tokens, so the speculation view survives a reload.

const CONVERSATIONS_KEY = "specserve.conversations.v1";
const SETTINGS_KEY = "specserve.settings.v1";
const API_KEY_KEY = "specserve.apiKey";

export const DEFAULT_SETTINGS = Object.freeze({
  systemPrompt: "",
  temperature: 0.7,
  topP: 1.0,
  maxTokens: null, // null: the server default, cut down to fit the context
  speculation: true,
  showDraft: true,
});

function readJSON(storage, key, fallback) {
  try {
    const raw = storage.getItem(key);
    return raw === null ? fallback : JSON.parse(raw);
  } catch {
    return fallback; // corrupt or unavailable storage must not stop the page from loading
  }
}

export function newId() {
  return crypto.randomUUID ? crypto.randomUUID()
    : `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;
}

export class ConversationStore {
  constructor(storage = window.localStorage) {
    this.storage = storage;
    const saved = readJSON(storage, CONVERSATIONS_KEY, []);
    this.conversations = Array.isArray(saved) ? saved.filter((c) => c && c.id) : [];
  }

  /** Most recently updated first. */
  list() {
    return [...this.conversations].sort((a, b) => b.updated - a.updated);
  }

  get(id) {
    return this.conversations.find((c) => c.id === id) ?? null;
  }

  create() {
    const conv = { id: newId(), title: "New chat", updated: Date.now(), messages: [] };
    this.conversations.push(conv);
    this.save();
    return conv;
  }

  remove(id) {
    this.conversations = this.conversations.filter((c) => c.id !== id);
    this.save();
  }

  touch(conv) {
    conv.updated = Date.now();
    if (conv.title === "New chat") {
      const first = conv.messages.find((m) => m.role === "user");
      if (first) conv.title = first.content.trim().split("\n")[0].slice(0, 60) || "New chat";
    }
    this.save();
  }

  save() {
    // When the quota is full, drop the oldest conversations rather than lose the current one.
    for (;;) {
      try {
        this.storage.setItem(CONVERSATIONS_KEY, JSON.stringify(this.conversations));
        return;
      } catch {
        if (this.conversations.length <= 1) return;
        const oldest = this.list().at(-1);
        this.conversations = this.conversations.filter((c) => c !== oldest);
      }
    }
  }
}

export function loadSettings(storage = window.localStorage) {
  return { ...DEFAULT_SETTINGS, ...readJSON(storage, SETTINGS_KEY, {}) };
}

export function saveSettings(settings, storage = window.localStorage) {
  try {
    storage.setItem(SETTINGS_KEY, JSON.stringify(settings));
  } catch {
    // Settings are a convenience; failing to persist them is not worth an error message.
  }
}

export function loadApiKey(storage = window.localStorage) {
  try {
    return storage.getItem(API_KEY_KEY) || "";
  } catch {
    return "";
  }
}

export function saveApiKey(key, storage = window.localStorage) {
  try {
    if (key) storage.setItem(API_KEY_KEY, key);
    else storage.removeItem(API_KEY_KEY);
  } catch {
    // Without storage the key lives only as long as the page.
  }
}
