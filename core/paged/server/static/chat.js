// The chat page of `paged serve` (GET /): streams /v1/chat/completions, keeps the
// conversation in localStorage. Plain JS, no dependencies; every URL is relative so the
// page works behind --root-path.
"use strict";

const STORE = "paged.chat";
const KEY_STORE = "paged.apiKey";
const DEFAULTS = { system: "", temperature: "0.7", top_p: "", max_tokens: "512" };

// ---- markdown: escape first, then add our own tags only ----

const ESC = { "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" };
const escapeHtml = (s) => s.replace(/[&<>"']/g, (c) => ESC[c]);
const SAFE_URL = /^(https?:\/\/|mailto:)/i;

function renderInline(raw) {
  // Code spans and links become placeholders so emphasis never reaches inside them.
  const held = [];
  const hold = (html) => `\u0000${held.push(html) - 1}\u0000`;
  let s = escapeHtml(raw);
  s = s.replace(/`([^`\n]+)`/g, (_, code) => hold(`<code>${code}</code>`));
  s = s.replace(/\[([^\]\n]+)\]\(([^)\s\u0000]+)\)/g, (m, label, url) =>
    SAFE_URL.test(url)
      ? hold(`<a href="${url}" target="_blank" rel="noopener noreferrer">${label}</a>`)
      : m,
  );
  s = s.replace(/\*\*(\S(?:[^*\n]*\S)?)\*\*/g, "<strong>$1</strong>");
  s = s.replace(/__(\S(?:[^_\n]*\S)?)__/g, "<strong>$1</strong>");
  s = s.replace(/(^|[^*\w])\*(\S(?:[^*\n]*\S)?)\*(?!\w)/g, "$1<em>$2</em>");
  s = s.replace(/(^|[^_\w])_(\S(?:[^_\n]*\S)?)_(?!\w)/g, "$1<em>$2</em>");
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

// ---- state kept in localStorage ----

function loadState() {
  let saved = {};
  try {
    saved = JSON.parse(localStorage.getItem(STORE)) || {};
  } catch {
    saved = {};
  }
  const messages = Array.isArray(saved.messages) ? saved.messages : [];
  for (const m of messages) if (m.state === "streaming") m.state = "stopped"; // reloaded mid-reply
  return { messages, settings: { ...DEFAULTS, ...(saved.settings || {}) } };
}

const state = loadState();
const saveState = () => localStorage.setItem(STORE, JSON.stringify(state));
const $ = (id) => document.getElementById(id);
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

async function api(path, init = {}) {
  for (;;) {
    const key = localStorage.getItem(KEY_STORE);
    const headers = { ...(init.headers || {}) };
    if (key) headers.Authorization = `Bearer ${key}`;
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
  el.querySelector(".meta").textContent = m.role === "assistant" ? metaText(m) : "";
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

function requestBody() {
  const s = state.settings;
  const history = state.messages
    .filter((m) => m.content && m.state !== "error")
    .map((m) => ({ role: m.role, content: m.content }));
  const messages = s.system.trim() ? [{ role: "system", content: s.system }, ...history] : history;
  const body = { messages, stream: true, stream_options: { include_usage: true } };
  if (modelId) body.model = modelId;
  const numbers = { temperature: parseFloat, top_p: parseFloat, max_tokens: parseInt };
  for (const [field, parse] of Object.entries(numbers)) {
    const v = parse(s[field]);
    if (Number.isFinite(v)) body[field] = v;
  }
  return body;
}

async function send() {
  const text = $("input").value.trim();
  if (!text || controller) return;
  $("input").value = "";
  state.messages.push({ role: "user", content: text });
  const body = requestBody();
  const reply = { role: "assistant", content: "", state: "streaming", deltas: 0 };
  state.messages.push(reply);
  saveState();
  renderAll();
  const el = $("messages").lastElementChild;
  controller = new AbortController();
  setBusy(true);
  setStatus("");
  const t0 = performance.now();
  let tFirst = null;
  let usage = null;
  try {
    const res = await api("v1/chat/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(body),
      signal: controller.signal,
    });
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
      fillMessage(el, reply);
      $("messages").scrollTop = $("messages").scrollHeight;
    }
    reply.state = "done";
  } catch (e) {
    if (e.name === "AbortError") reply.state = "stopped";
    else {
      reply.state = "error";
      reply.error = e.message;
    }
  } finally {
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

function bindSetting(id, field) {
  const input = $(id);
  input.value = state.settings[field];
  input.addEventListener("input", () => {
    state.settings[field] = input.value;
    saveState();
  });
}

function init() {
  bindSetting("system", "system");
  bindSetting("temperature", "temperature");
  bindSetting("top-p", "top_p");
  bindSetting("max-tokens", "max_tokens");
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

window.pagedChat = { renderMarkdown }; // for tests and the console
document.addEventListener("DOMContentLoaded", init);
