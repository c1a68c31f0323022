// The chat page of `paged serve` (GET /): streams /v1/chat/completions. The conversation is
// the tab's own (sessionStorage: a reload keeps it, another tab never overwrites it); the
// settings and the API key are shared by the tabs (localStorage, kept in step by the
// `storage` event). Plain JS, no dependencies; every URL is relative so the page works
// behind --root-path.
"use strict";

const STORE = "paged.chat"; // sessionStorage: this tab's conversation
const SETTINGS_STORE = "paged.settings"; // localStorage: the settings, shared by the tabs
const KEY_STORE = "paged.apiKey";
const DEFAULTS = { system: "", temperature: "0.7", top_p: "", max_tokens: "512" };

// ---- markdown: escape first, then add our own tags only ----

const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);
const SAFE_URL = /^(https?:\/\/|mailto:)/i;

// Bold and italic on escaped text: the tags added are the only markup.
function emphasize(s) {
  s = s.replace(/\*\*(\S(?:[^*\n]*\S)?)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/__(\S(?:[^_\n]*\S)?)__/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*(\S(?:[^*\n]*\S)?)\*(?!\w)/g, "$1<em>$2</em>");
  return s.replace(/(^|[^_\w])_(\S(?:[^_\n]*\S)?)_(?!\w)/g, "$1<em>$2</em>");
}

function renderInline(raw) {
  // Code spans and links become placeholders so emphasis never reaches inside them.
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = escapeHtml(raw);
  s = s.replace(/`([^`\n]+)`/g, (_, code) => hold(`<code>${code}</code>`));
  // A link label gets its emphasis here, the URL never does (it is held whole).
  s = s.replace(/\[([^\]\n]+)\]\(([^)\s\u0000]+)\)/g, (m, label, url) =>
    SAFE_URL.test(url)
      ? hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${emphasize(label)}</a>`)
      : m,
  );
  s = emphasize(s);
  // Placeholders may nest (a code span inside a link label): resolve until none is left.
  while (/\u0000\d+\u0000/.test(s)) s = s.replace(/\u0000(\d+)\u0000/g, (_, i) => held[+i]);
  return s;
}

const FENCE = /^\s*(`{3,}|~{3,})\s*([\w+#.-]*)/;
const HEADING = /^(#{1,6})\s+(.*)$/;
const ITEM = /^\s*([-*+]|\d+[.)])\s+(.*)$/;
const QUOTE = /^\s*>\s?(.*)$/;
const RULE = /^\s*([-*_])(\s*\1){2,}\s*$/;

function renderMarkdown(src) {
  const lines = src.replace(/\u0000/g, "").replace(/\r\n?/g, "\n").split("\n");
  const out = [];
  let i = 0;
  const special = (l) => FENCE.test(l) || HEADING.test(l) || ITEM.test(l) || QUOTE.test(l);
  while (i < lines.length) {
    const line = lines[i];
    let m;
    if ((m = line.match(FENCE))) {
      const code = [];
      for (i++; i < lines.length && !lines[i].trim().startsWith(m[1]); i++) code.push(lines[i]);
      i++; // the closing fence (absent while a reply is still streaming)
      const cls = m[2] ? ` class="lang-${escapeHtml(m[2])}"` : "";
      out.push(`<pre><code${cls}>${escapeHtml(code.join("\n"))}</code></pre>`);
    } else if (!line.trim()) {
      i++;
    } else if (RULE.test(line)) {
      out.push("<hr>");
      i++;
    } else if ((m = line.match(HEADING))) {
      const n = m[1].length;
      out.push(`<h${n}>${renderInline(m[2])}</h${n}>`);
      i++;
    } else if ((m = line.match(ITEM))) {
      const ordered = /\d/.test(m[1]);
      const items = [];
      const start = ordered ? parseInt(m[1], 10) : 1;
      while (i < lines.length && (m = lines[i].match(ITEM)) && /\d/.test(m[1]) === ordered) {
        items.push(`<li>${renderInline(m[2])}</li>`);
        i++;
      }
      const tag = ordered ? "ol" : "ul";
      const attr = ordered && start !== 1 ? ` start="${start}"` : "";
      out.push(`<${tag}${attr}>${items.join("")}</${tag}>`);
    } else if (QUOTE.test(line)) {
      const quoted = [];
      while (i < lines.length && (m = lines[i].match(QUOTE))) {
        quoted.push(m[1]);
        i++;
      }
      out.push(`<blockquote>${renderMarkdown(quoted.join("\n"))}</blockquote>`);
    } else {
      const para = [];
      while (i < lines.length && lines[i].trim() && !special(lines[i]) && !RULE.test(lines[i]))
        para.push(renderInline(lines[i++]));
      out.push(`<p>${para.join("<br>")}</p>`);
    }
  }
  return out.join("");
}

// ---- state: the conversation in sessionStorage, the settings in localStorage ----

function readJson(storage, key) {
  try {
    return JSON.parse(storage.getItem(key)) || {};
  } catch {
    return {};
  }
}

function loadState() {
  let saved = readJson(sessionStorage, STORE);
  let settings = readJson(localStorage, SETTINGS_STORE);
  const legacy = localStorage.getItem(STORE); // an older page kept both in localStorage
  if (legacy !== null) {
    const old = readJson(localStorage, STORE);
    if (!sessionStorage.getItem(STORE)) saved = old; // the first tab opened takes it over
    if (!localStorage.getItem(SETTINGS_STORE)) settings = old.settings || {};
    localStorage.removeItem(STORE);
  }
  const messages = Array.isArray(saved.messages) ? saved.messages : [];
  for (const m of messages) if (m.state === "streaming") m.state = "stopped"; // reloaded mid-reply
  return { messages, settings: { ...DEFAULTS, ...settings } };
}

const state = loadState();
const $ = (id) => document.getElementById(id);

function store(storage, key, value) {
  try {
    storage.setItem(key, JSON.stringify(value));
  } catch (e) {
    setStatus(`not saved in the browser: ${e.message}`, true); // quota exceeded
  }
}
const saveState = () => store(sessionStorage, STORE, { messages: state.messages });
const saveSettings = () => store(localStorage, SETTINGS_STORE, state.settings);
let controller = null; // the AbortController of the reply being streamed
let modelId = null;

// ---- API key: asked for on a 401, kept in localStorage ----

let keyWaiters = [];

function askKey(refused) {
  const dialog = $("key-dialog");
  $("key-msg").textContent = refused ? "The server refused this key; enter it again." : "";
  $("key-input").value = "";
  if (!dialog.open) dialog.showModal();
  return new Promise((resolve) => keyWaiters.push(resolve));
}

function keySubmitted() {
  const key = $("key-input").value.trim();
  if (!key) return;
  localStorage.setItem(KEY_STORE, key);
  const waiters = keyWaiters;
  keyWaiters = [];
  for (const resolve of waiters) resolve();
}

// `sent` is called as each attempt goes out (after any wait for the key): the time a
// request took starts there.
async function api(path, init = {}, sent = () => {}) {
  for (;;) {
    const key = localStorage.getItem(KEY_STORE);
    const headers = { ...(init.headers || {}) };
    if (key) headers.Authorization = `Bearer ${key}`;
    sent();
    const res = await fetch(path, { ...init, headers });
    if (res.status !== 401) return res;
    await askKey(Boolean(key));
  }
}

async function errorText(res) {
  const text = await res.text();
  try {
    return JSON.parse(text).error.message || text;
  } catch {
    return text || `HTTP ${res.status}`;
  }
}

// ---- server info: the model (GET v1/models) and the platform (GET fleet) ----

async function loadInfo() {
  try {
    const res = await api("v1/models");
    if (!res.ok) throw new Error(await errorText(res));
    modelId = (await res.json()).data[0].id;
    $("model").textContent = modelId;
  } catch (e) {
    $("model").textContent = "unavailable";
    setStatus(`models: ${e.message}`, true);
  }
  try {
    const res = await api("fleet");
    if (!res.ok) throw new Error(await errorText(res));
    const platforms = (await res.json()).replicas.map((r) => r.platform || "?");
    const counts = new Map();
    for (const p of platforms) counts.set(p, (counts.get(p) || 0) + 1);
    $("platform").textContent = [...counts]
      .map(([p, n]) => (n > 1 ? `${p} ×${n}` : p))
      .join(", ");
  } catch {
    $("platform").textContent = "unknown";
  }
}

// ---- rendering ----

function setStatus(text, error = false) {
  $("status").textContent = text;
  $("status").classList.toggle("error", error);
}

function metaText(m) {
  const parts = [];
  if (m.tokens !== undefined) parts.push(`${m.tokens} tokens`);
  if (m.speed) parts.push(`${m.speed.toFixed(1)} tok/s`);
  if (m.ttft !== undefined) parts.push(`first token ${m.ttft.toFixed(2)} s`);
  if (m.state === "stopped") parts.push("stopped");
  if (m.finish === "length") parts.push("max tokens reached");
  if (m.error) parts.push(`error: ${m.error}`);
  return parts.join(" · ");
}

function fillMessage(el, m) {
  el.className = `msg ${m.role}`;
  el.dataset.state = m.state || "done";
  el.dataset.deltas = String(m.deltas || 0);
  const body = el.querySelector(".body");
  if (m.role === "user") body.textContent = m.content;
  else body.innerHTML = renderMarkdown(m.content);
  const think = el.querySelector(".reasoning");
  think.hidden = !m.reasoning;
  think.querySelector("div").textContent = m.reasoning || "";
  const failed = "not answered: left out of the conversation from now on";
  el.querySelector(".meta").textContent =
    m.role === "assistant" ? metaText(m) : m.state === "failed" ? failed : "";
}

// Whether the view is at (or near) its bottom: only then does a streamed reply scroll it,
// so that one can scroll up and read while a reply arrives.
function atBottom(box) {
  return box.scrollHeight - box.scrollTop - box.clientHeight < 40;
}

function messageElement(m) {
  const el = document.createElement("div");
  el.innerHTML =
    '<details class="reasoning" hidden><summary>reasoning</summary><div></div></details>' +
    '<div class="body"></div><div class="meta"></div>';
  fillMessage(el, m);
  return el;
}

function renderAll() {
  const box = $("messages");
  box.replaceChildren(...state.messages.map(messageElement));
  box.scrollTop = box.scrollHeight;
}

function setBusy(busy) {
  $("send").hidden = busy;
  $("stop").hidden = !busy;
}

// ---- streaming ----

// Server-sent events of a fetch body: yields each event's data.
async function* sseData(body) {
  const reader = body.pipeThrough(new TextDecoderStream()).getReader();
  let buf = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) break;
    buf += value.replace(/\r\n?/g, "\n");
    let cut;
    while ((cut = buf.indexOf("\n\n")) >= 0) {
      const event = buf.slice(0, cut);
      buf = buf.slice(cut + 2);
      const data = event
        .split("\n")
        .filter((l) => l.startsWith("data:"))
        .map((l) => l.slice(5).replace(/^ /, ""));
      if (data.length) yield data.join("\n");
    }
  }
}

// ---- settings: checked before they are sent, never silently altered ----

const FIELDS = {
  temperature: {
    id: "temperature",
    label: "Temperature",
    ok: (v) => v >= 0 && v <= 2,
    want: "a number from 0 to 2",
  },
  top_p: {
    id: "top-p",
    label: "Top p",
    ok: (v) => v > 0 && v <= 1,
    want: "a number above 0, at most 1",
  },
  max_tokens: {
    id: "max-tokens",
    label: "Max tokens",
    ok: (v) => Number.isInteger(v) && v >= 1,
    want: "a whole number, at least 1",
  },
};

// The value of a number setting: undefined when empty (the server's default), else a number;
// an error message when it is not a valid value.
function settingValue(field) {
  const f = FIELDS[field];
  const input = $(f.id);
  const raw = String(state.settings[field] ?? "").trim();
  if (input && input.validity.badInput) return { error: `${f.label}: not a number` };
  if (!raw) return {};
  const v = Number(raw);
  if (!Number.isFinite(v) || !f.ok(v)) return { error: `${f.label}: ${raw} is not ${f.want}` };
  return { value: v };
}

// Marks each invalid field and lists the problems under the settings; returns them.
function checkSettings() {
  const problems = [];
  for (const [field, f] of Object.entries(FIELDS)) {
    const { error } = settingValue(field);
    const input = $(f.id);
    input.classList.toggle("invalid", Boolean(error));
    input.setAttribute("aria-invalid", String(Boolean(error)));
    input.title = error || "";
    if (error) problems.push(error);
  }
  const box = $("settings-error");
  box.textContent = problems.join("\n");
  box.hidden = !problems.length;
  return problems;
}

// The history sent: a user turn only while it has an answer (or is the one being sent now),
// so a failed request (its user turn marked "failed") never goes out again.
function history(messages) {
  const out = [];
  messages.forEach((m, i) => {
    const next = messages[i + 1];
    const answered = next && next.role === "assistant" && next.content && next.state !== "error";
    const keep =
      m.role === "user"
        ? m.state !== "failed" && (answered || !next)
        : m.content && m.state !== "error";
    if (keep) out.push({ role: m.role, content: m.content });
  });
  return out;
}

function requestBody() {
  const s = state.settings;
  const turns = history(state.messages);
  const messages = s.system.trim() ? [{ role: "system", content: s.system }, ...turns] : turns;
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (modelId) body.model = modelId;
  for (const field of Object.keys(FIELDS)) {
    const { value } = settingValue(field);
    if (value !== undefined) body[field] = value;
  }
  return body;
}

async function send() {
  const text = $("input").value.trim();
  if (!text || controller) return;
  const problems = checkSettings();
  if (problems.length) {
    setStatus(`Not sent: ${problems.join("; ")}`, true);
    return;
  }
  $("input").value = "";
  const turn = { role: "user", content: text };
  state.messages.push(turn);
  const body = requestBody();
  const reply = { role: "assistant", content: "", state: "streaming", deltas: 0 };
  state.messages.push(reply);
  saveState();
  renderAll();
  const box = $("messages");
  const el = box.lastElementChild;
  controller = new AbortController();
  setBusy(true);
  setStatus("");
  let t0 = performance.now();
  let tFirst = null;
  let usage = null;
  try {
    const init = {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    };
    const res = await api("v1/chat/completions", init, () => (t0 = performance.now()));
    if (!res.ok) throw new Error(await errorText(res));
    for await (const data of sseData(res.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) throw new Error(chunk.error.message);
      if (chunk.usage) usage = chunk.usage;
      const choice = chunk.choices && chunk.choices[0];
      if (!choice) continue;
      const delta = choice.delta || {};
      if (delta.content || delta.reasoning_content) {
        tFirst = tFirst ?? performance.now();
        reply.content += delta.content || "";
        if (delta.reasoning_content)
          reply.reasoning = (reply.reasoning || "") + delta.reasoning_content;
        reply.deltas++;
      }
      if (choice.finish_reason) reply.finish = choice.finish_reason;
      const follow = atBottom(box);
      fillMessage(el, reply);
      if (follow) box.scrollTop = box.scrollHeight;
    }
    reply.state = "done";
  } catch (e) {
    if (e.name === "AbortError") reply.state = "stopped";
    else {
      reply.state = "error";
      reply.error = e.message;
      setStatus(`The request failed: ${e.message}`, true);
    }
  } finally {
    // Unanswered (an error, or stopped before any text): the turn is not sent again.
    if (reply.state === "error" || !reply.content) {
      turn.state = "failed";
      if (el.previousElementSibling) fillMessage(el.previousElementSibling, turn);
    }
    const tEnd = performance.now();
    // Tokens: the server's count when it sent usage, else the deltas rendered.
    reply.tokens = usage ? usage.completion_tokens : reply.deltas;
    if (tFirst !== null) {
      reply.ttft = (tFirst - t0) / 1000;
      const decode = (tEnd - tFirst) / 1000; // the first token ends the prefill
      reply.speed = reply.tokens > 1 && decode > 0 ? (reply.tokens - 1) / decode : 0;
    }
    controller = null;
    saveState();
    fillMessage(el, reply);
    setBusy(false);
    $("input").focus();
  }
}

// ---- wiring ----

const SETTING_IDS = {
  system: "system",
  temperature: "temperature",
  top_p: "top-p",
  max_tokens: "max-tokens",
};

function bindSetting(field) {
  const input = $(SETTING_IDS[field]);
  input.value = state.settings[field];
  const changed = () => {
    state.settings[field] = input.value;
    saveSettings();
    checkSettings();
  };
  input.addEventListener("input", changed);
  input.addEventListener("change", changed); // a field cleared by a script fires only this
}

// Another tab changed the settings: take them (the conversation is each tab's own).
function settingsChanged(e) {
  if (e.key !== SETTINGS_STORE || e.storageArea !== localStorage) return;
  state.settings = { ...DEFAULTS, ...readJson(localStorage, SETTINGS_STORE) };
  for (const [field, id] of Object.entries(SETTING_IDS))
    if ($(id).value !== state.settings[field]) $(id).value = state.settings[field];
  checkSettings();
}

function init() {
  for (const field of Object.keys(SETTING_IDS)) bindSetting(field);
  window.addEventListener("storage", settingsChanged);
  checkSettings();
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("input").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("stop").addEventListener("click", () => controller && controller.abort());
  $("new-chat").addEventListener("click", () => {
    if (controller) controller.abort();
    state.messages = [];
    saveState();
    renderAll();
    setStatus("");
  });
  $("key-form").addEventListener("submit", keySubmitted);
  $("key-dialog").addEventListener("cancel", (e) => e.preventDefault()); // a key is needed
  renderAll();
  loadInfo();
}

window.pagedChat = { renderMarkdown, requestBody }; // for tests and the console
document.addEventListener("DOMContentLoaded", init);
