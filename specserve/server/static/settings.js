// The settings panel: system prompt, sampling and speculation. Every change is saved at once
// and read back by the chat controller when it builds the next request.

import { saveSettings } from "./store.js";

export class SettingsPanel {
  constructor(doc, settings, { onChange = () => {} } = {}) {
    this.settings = settings;
    this.onChange = onChange;
    this.panel = doc.getElementById("settings");
    this.toggleButton = doc.getElementById("settings-toggle");
    this.fields = {
      systemPrompt: doc.getElementById("system-prompt"),
      temperature: doc.getElementById("temperature"),
      topP: doc.getElementById("top-p"),
      maxTokens: doc.getElementById("max-tokens"),
      speculation: doc.getElementById("speculation"),
    };
    this.outputs = {
      temperature: doc.getElementById("temperature-value"),
      topP: doc.getElementById("top-p-value"),
    };
    // Browsers without plaintext-only editing get plain contenteditable; we read innerText.
    if (this.fields.systemPrompt.contentEditable !== "plaintext-only") {
      this.fields.systemPrompt.contentEditable = "true";
    }
    this.fill();

    this.toggleButton.addEventListener("click", () => this.setOpen(this.panel.hidden));
    for (const [name, input] of Object.entries(this.fields)) {
      input.addEventListener("input", () => this.read(name));
    }
  }

  setOpen(open) {
    this.panel.hidden = !open;
    this.toggleButton.setAttribute("aria-expanded", String(open));
  }

  fill() {
    const s = this.settings;
    const f = this.fields;
    f.systemPrompt.textContent = s.systemPrompt;
    f.temperature.value = String(s.temperature);
    f.topP.value = String(s.topP);
    f.maxTokens.value = s.maxTokens === null ? "" : String(s.maxTokens);
    f.maxTokens.placeholder = "server default";
    f.speculation.checked = s.speculation;
    this.showValues();
  }

  showValues() {
    this.outputs.temperature.textContent = Number(this.settings.temperature).toFixed(2);
    this.outputs.topP.textContent = Number(this.settings.topP).toFixed(2);
  }

  read(name) {
    const input = this.fields[name];
    const s = this.settings;
    if (name === "systemPrompt") s.systemPrompt = input.innerText.replace(/\n$/, "");
    if (name === "temperature") s.temperature = Number(input.value);
    if (name === "topP") s.topP = Number(input.value);
    if (name === "speculation") s.speculation = input.checked;
    if (name === "maxTokens") {
      // Empty means "let the server choose" (it then fits the reply into the context).
      const n = parseInt(input.value, 10);
      s.maxTokens = Number.isFinite(n) && n >= 1 ? n : null;
    }
    this.showValues();
    saveSettings(s);
    this.onChange(s);
  }

  /** Adapt to what the server offers (from session.created). */
  applySession(session) {
    const limits = session.limits || {};
    if (limits.max_output_tokens) this.fields.maxTokens.max = String(limits.max_output_tokens);
    const canSpeculate = session.speculation !== "off";
    this.fields.speculation.disabled = !canSpeculate;
    this.fields.speculation.parentElement.title = canSpeculate
      ? `server mode: ${session.speculation ?? "default"}`
      : "this server has no draft model";
  }
}
