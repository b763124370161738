// The chat playground: settings, a streamed conversation kept in localStorage, and a stop button.

import { streamChat } from "./api.js";
import { render } from "./markdown.js";

const STORE = "wllm.chat";
const $ = (id) => document.getElementById(id);

let state = load();
let controller = null; // the AbortController of the reply being streamed

function load() {
  try {
    const saved = JSON.parse(localStorage.getItem(STORE) || "null");
    if (saved && Array.isArray(saved.messages) && saved.settings) return saved;
  } catch {
    // a damaged entry: start over
  }
  return { messages: [], settings: {} };
}

function save() {
  try {
    localStorage.setItem(STORE, JSON.stringify(state));
  } catch (err) {
    showError(`could not save the conversation in this browser: ${err.message}`);
  }
}

function showError(message) {
  $("chat-error").textContent = message || "";
}

// Settings as the request needs them, or throws an Error that says what is wrong.
function settings() {
  const model = $("model").value;
  if (!model) throw new Error("no model to send to: the model list could not be loaded");
  const number = (id, name, lo, hi) => {
    const text = $(id).value.trim();
    const value = Number(text);
    if (text === "" || !Number.isFinite(value) || value < lo || value > hi) {
      throw new Error(`${name} must be a number from ${lo} to ${hi}, got "${text}"`);
    }
    return value;
  };
  const body = {
    model,
    temperature: number("temperature", "temperature", 0, 2),
    top_p: number("top-p", "top-p", 0.01, 1),
  };
  const maxText = $("max-tokens").value.trim();
  if (maxText !== "") {
    const maxTokens = Number(maxText);
    if (!Number.isInteger(maxTokens) || maxTokens < 1) {
      throw new Error(`max tokens must be a whole number of 1 or more (or empty for the rest of the context), got "${maxText}"`);
    }
    body.max_tokens = maxTokens;
  }
  return body;
}

function rememberSettings() {
  state.settings = {
    model: $("model").value, system: $("system").value, temperature: $("temperature").value,
    top_p: $("top-p").value, max_tokens: $("max-tokens").value,
  };
  save();
}

function messageNode(message) {
  const node = document.createElement("div");
  node.className = `message ${message.role}`;
  const role = document.createElement("div");
  role.className = "role";
  role.textContent = message.role === "user" ? "You" : (message.model || "Assistant");
  const content = document.createElement("div");
  content.className = "content";
  const meta = document.createElement("div");
  meta.className = "meta";
  node.append(role, content, meta);
  fill(node, message);
  return node;
}

function fill(node, message) {
  const content = node.querySelector(".content");
  if (message.role === "assistant") content.replaceChildren(render(message.content));
  else content.textContent = message.content;
  node.querySelector(".meta").textContent = message.meta || "";
  node.dataset.state = message.state || "done";
}

function renderAll() {
  $("messages").replaceChildren(...state.messages.map(messageNode));
  scrollDown();
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("new-chat").disabled = on;
}

async function send() {
  showError("");
  const text = $("prompt").value.trim();
  if (!text) {
    showError("type a message first");
    return;
  }
  let body;
  try {
    body = settings();
  } catch (err) {
    showError(err.message);
    return;
  }
  rememberSettings();
  const history = state.messages
    .filter((m) => m.content && m.state !== "error")
    .map((m) => ({ role: m.role, content: m.content }));
  const system = $("system").value.trim();
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...history,
    { role: "user", content: text }];
  state.messages.push({ role: "user", content: text });
  const reply = { role: "assistant", content: "", model: body.model, state: "streaming", meta: "waiting…" };
  state.messages.push(reply);
  $("prompt").value = "";
  renderAll();
  const node = $("messages").lastChild;

  controller = new AbortController();
  busy(true);
  const started = performance.now();
  let firstAt = null;
  let pieces = 0;
  let pending = false;
  const paint = () => {
    pending = false;
    fill(node, reply);
    scrollDown();
  };
  try {
    const { usage, finishReason } = await streamChat({ ...body, messages }, {
      signal: controller.signal,
      onDelta: (delta) => {
        if (firstAt === null) firstAt = performance.now();
        pieces += 1;
        reply.content += delta;
        reply.meta = "streaming…";
        if (!pending) {
          pending = true;
          setTimeout(paint, 40);
        }
      },
    });
    const tokens = usage ? usage.completion_tokens : pieces;
    const seconds = (performance.now() - started) / 1000;
    const ttft = firstAt === null ? null : (firstAt - started) / 1000;
    const rate = ttft !== null && seconds > ttft ? ` · ${((tokens - 1) / (seconds - ttft)).toFixed(1)} tokens/s` : "";
    reply.state = "done";
    reply.meta = `${tokens} tokens in ${seconds.toFixed(2)} s${rate}` +
      (ttft !== null ? ` · first token after ${ttft.toFixed(2)} s` : "") +
      (finishReason && finishReason !== "stop" ? ` · finished: ${finishReason}` : "");
  } catch (err) {
    if (err.name === "AbortError") {
      reply.state = "stopped";
      reply.meta = `stopped after ${pieces} pieces`;
    } else {
      reply.state = "error";
      reply.meta = `error: ${err.message}`;
      showError(err.message);
    }
  } finally {
    controller = null;
    busy(false);
    paint();
    save();
  }
}

function stop() {
  if (controller) controller.abort();
}

function newChat() {
  state.messages = [];
  save();
  renderAll();
  showError("");
}

// Fill the model picker from /v1/models (every model the server serves).
export function setModels(models) {
  const select = $("model");
  const wanted = select.value || state.settings.model;
  select.replaceChildren(...models.map((m) => {
    const option = document.createElement("option");
    option.value = m.id;
    option.textContent = m.max_model_len ? `${m.id} (${m.max_model_len} tokens)` : m.id;
    return option;
  }));
  if (models.some((m) => m.id === wanted)) select.value = wanted;
}

export function currentModel() {
  return $("model").value;
}

export function initChat() {
  const s = state.settings;
  if (s.system !== undefined) $("system").value = s.system;
  if (s.temperature !== undefined) $("temperature").value = s.temperature;
  if (s.top_p !== undefined) $("top-p").value = s.top_p;
  if (s.max_tokens !== undefined) $("max-tokens").value = s.max_tokens;
  // A reply that was streaming when the page went away did not finish.
  for (const m of state.messages) {
    if (m.state === "streaming") {
      m.state = "stopped";
      m.meta = "interrupted (the page was closed)";
    }
  }
  renderAll();
  $("composer").addEventListener("submit", (event) => {
    event.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (event) => {
    if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
      event.preventDefault();
      if (!controller) send();
    }
  });
  $("stop").addEventListener("click", stop);
  $("new-chat").addEventListener("click", newChat);
  for (const id of ["model", "system", "temperature", "top-p", "max-tokens"]) {
    $(id).addEventListener("change", rememberSettings);
  }
}
