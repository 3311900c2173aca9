// Boot: wire the stored state, the socket, the views and the controls together.

import { ChatController } from "./chat.js";
import { Connection } from "./connection.js";
import { LiveView } from "./live_view.js";
import { MessagesView } from "./messages_view.js";
import { SettingsPanel } from "./settings.js";
import { Sidebar } from "./sidebar.js";
import { StatusView } from "./status.js";
import {
  ConversationStore, loadApiKey, loadSettings, saveApiKey, saveSettings,
} from "./store.js";

const $ = (id) => document.getElementById(id);

const store = new ConversationStore();
// A reply that was streaming when the page went away was cancelled by the server with the socket.
for (const conv of store.conversations) {
  for (const m of conv.messages) if (m.status === "streaming") m.status = "interrupted";
}

const settings = loadSettings();
const connection = new Connection({ apiKey: loadApiKey() });
const view = new MessagesView($("messages"));
const live = new LiveView(document);
const status = new StatusView(document, {
  onRetry: () => connection.retryNow(),
  onEnterKey: () => askForKey(),
});
const settingsPanel = new SettingsPanel(document, settings);
const chat = new ChatController({ connection, store, settings, view, live, status });
const sidebar = new Sidebar($("conversation-list"), {
  onOpen: (id) => openConversation(store.get(id)),
  onDelete: (id) => deleteConversation(id),
});

// ---- conversations ------------------------------------------------------------------------
function openConversation(conv) {
  chat.open(conv);
  sidebar.render(store.list(), conv.id);
}

function newChat() {
  // Reuse an untouched empty chat instead of piling up blank ones.
  const current = chat.conversation;
  if (current && current.messages.length === 0) {
    $("prompt").focus();
    return;
  }
  openConversation(store.create());
  $("prompt").focus();
}

function deleteConversation(id) {
  if (chat.busy && chat.active.conv.id === id) chat.stop();
  store.remove(id);
  if (chat.conversation?.id === id) {
    openConversation(store.list()[0] ?? store.create());
  } else {
    sidebar.render(store.list(), chat.conversation?.id);
  }
}

// ---- controls -----------------------------------------------------------------------------
const prompt = $("prompt");

function updateControls() {
  const open = connection.state === "open";
  $("send").hidden = chat.busy;
  $("send").disabled = !open;
  $("stop").hidden = !chat.busy;
  $("stop").disabled = chat.stopping;
  $("stop").textContent = chat.stopping ? "Stopping…" : "Stop";
  $("regenerate").disabled = !open || !chat.canRegenerate;
  sidebar.render(store.list(), chat.conversation?.id);
}

function submit() {
  if (chat.send(prompt.value)) prompt.value = "";
}

$("composer").addEventListener("submit", (ev) => {
  ev.preventDefault();
  submit();
});
prompt.addEventListener("keydown", (ev) => {
  // Enter sends, Shift+Enter is a new line; Enter that confirms an IME composition is neither.
  if (ev.key === "Enter" && !ev.shiftKey && !ev.isComposing) {
    ev.preventDefault();
    submit();
  }
});
$("stop").addEventListener("click", () => chat.stop());
$("regenerate").addEventListener("click", () => chat.regenerate());
$("new-chat").addEventListener("click", newChat);
document.addEventListener("keydown", (ev) => {
  if (ev.key === "Escape" && chat.busy) chat.stop();
});

const showDraft = $("show-draft");
showDraft.checked = settings.showDraft;
view.setShowDraft(settings.showDraft);
showDraft.addEventListener("change", () => {
  settings.showDraft = showDraft.checked;
  view.setShowDraft(showDraft.checked);
  saveSettings(settings);
});

chat.addEventListener("change", updateControls);

// ---- connection and API key ---------------------------------------------------------------
const keyDialog = $("api-key-dialog");

function askForKey() {
  if (keyDialog.open) return;
  $("api-key").value = "";
  keyDialog.showModal();
}

keyDialog.addEventListener("close", () => {
  if (keyDialog.returnValue !== "ok") return;
  const key = $("api-key").value.trim();
  if (!key) return;
  saveApiKey(key);
  connection.setApiKey(key);
  connection.retryNow();
});

$("forget-key").addEventListener("click", () => {
  saveApiKey("");
  connection.setApiKey("");
  connection.retryNow();
});

connection.addEventListener("state", (ev) => {
  const { state } = ev.detail;
  status.setConnection(ev.detail);
  if (state !== "open") chat.connectionLost();
  if (state === "unauthorized") askForKey();
  if (state === "open") {
    const session = connection.session;
    $("model-name").textContent = session.model ?? "";
    settingsPanel.applySession(session);
  }
  updateControls();
});
connection.addEventListener("message", (ev) => chat.handle(ev.detail.event));

// Ask for a key before the first connect when the server says it needs one and we have none.
async function start() {
  openConversation(store.list()[0] ?? store.create());
  let authRequired = false;
  try {
    const health = await fetch("health", { cache: "no-store" });
    authRequired = (await health.json()).auth_required === true;
  } catch {
    // /health unreachable: connecting will report the problem with a retry.
  }
  if (authRequired && !connection.apiKey) {
    status.setConnection({ state: "unauthorized", reason: "enter it to connect" });
    askForKey();
    updateControls();
    return;
  }
  connection.connect();
}

start();
