// The chat playground: settings (sampling, response format, tools), a streamed conversation kept in
// localStorage, a stop button, and tool calls answered with the user's tool results.

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

const SETTINGS = {
  model: "model", system: "system", temperature: "temperature", top_p: "top-p", max_tokens: "max-tokens",
  response_format: "response-format", json_schema: "json-schema", tools: "tools", tool_choice: "tool-choice",
  parallel_tool_calls: "parallel-tool-calls",
};
// A setting as stored: a checkbox's state, else the field's text.
const fieldValue = (id) => ($(id).type === "checkbox" ? $(id).checked : $(id).value);

// Marks the field as invalid and throws the message.
function fail(id, message) {
  $(id).setAttribute("aria-invalid", "true");
  throw new Error(message);
}

const isObject = (v) => v !== null && typeof v === "object" && !Array.isArray(v);

// The field's text parsed as JSON, undefined when empty.
function jsonField(id, name) {
  const text = $(id).value.trim();
  if (!text) return undefined;
  try {
    return JSON.parse(text);
  } catch (err) {
    return fail(id, `${name} is not valid JSON (${err.message}); nothing was sent`);
  }
}

// Settings as the request needs them, or throws an Error that says what is wrong.
function settings() {
  for (const id of Object.values(SETTINGS)) $(id).removeAttribute("aria-invalid");
  const model = $("model").value;
  if (!model) throw new Error("no model to send to: the model list could not be loaded");
  const number = (id, name, lo, hi) => {
    const text = $(id).value.trim();
    const value = Number(text);
    if (text === "" || !Number.isFinite(value) || value < lo || value > hi) {
      fail(id, `${name} must be a number from ${lo} to ${hi}, got "${text}"`);
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
      fail("max-tokens", `max tokens must be a whole number of 1 or more (or empty for the rest of the context), got "${maxText}"`);
    }
    body.max_tokens = maxTokens;
  }
  const format = $("response-format").value;
  if (format === "json_object") {
    body.response_format = { type: "json_object" };
  } else if (format === "json_schema") {
    const schema = jsonField("json-schema", "the JSON schema");
    if (!isObject(schema)) {
      fail("json-schema", schema === undefined
        ? "JSON schema mode needs a schema: type one, or pick another response format"
        : "the JSON schema must be a JSON object, e.g. {\"type\": \"object\", \"properties\": {...}}");
    }
    body.response_format = { type: "json_schema", json_schema: { name: "response", schema, strict: true } };
  }
  const tools = jsonField("tools", "the tool definitions");
  if (tools !== undefined) {
    if (!Array.isArray(tools)) fail("tools", "the tool definitions must be a JSON array of tool objects, [...]");
    tools.forEach((tool, i) => {
      if (!isObject(tool) || tool.type !== "function" || !isObject(tool.function) ||
          typeof tool.function.name !== "string" || !tool.function.name) {
        fail("tools", `tool ${i + 1} must look like {"type": "function", "function": {"name": "...", "parameters": {...}}}`);
      }
    });
    if (tools.length) {
      body.tools = tools;
      body.tool_choice = $("tool-choice").value;
      if (!$("parallel-tool-calls").checked) body.parallel_tool_calls = false;
    }
  }
  return body;
}

function rememberSettings() {
  state.settings = Object.fromEntries(Object.entries(SETTINGS).map(([key, id]) => [key, fieldValue(id)]));
  save();
}

function showSchemaField() {
  $("json-schema-field").hidden = $("response-format").value !== "json_schema";
}

function element(tag, className, text) {
  const node = document.createElement(tag);
  if (className) node.className = className;
  if (text !== undefined) node.textContent = text;
  return node;
}

function roleLabel(message) {
  if (message.role === "user") return "You";
  if (message.role === "tool") return `Tool result${message.name ? ` · ${message.name}` : ""}`;
  return message.model || "Assistant";
}

function messageNode(message) {
  const node = element("div", `message ${message.role}`);
  node.append(element("div", "role", roleLabel(message)), element("div", "content"), element("div", "tool-calls"),
    element("div", "meta"));
  fill(node, message);
  return node;
}

function fill(node, message) {
  const content = node.querySelector(".content");
  if (message.role !== "assistant") {
    content.textContent = message.content;
  } else if (message.format === "json") {
    const pre = element("pre");
    pre.append(element("code", "", message.content));
    content.replaceChildren(...(message.content ? [pre] : []));
  } else {
    content.replaceChildren(render(message.content || ""));
  }
  // Tool calls: the function name and its arguments as streamed, as text.
  node.querySelector(".tool-calls").replaceChildren(...(message.tool_calls || []).filter(Boolean).map((call) => {
    const box = element("div", "tool-call");
    box.dataset.callId = call.id;
    const args = element("pre", "tool-args");
    args.append(element("code", "", call.function.arguments));
    box.append(element("div", "tool-name", call.function.name), args);
    return box;
  }));
  node.querySelector(".meta").textContent = message.meta || "";
  node.dataset.state = message.state || "done";
}

// A call the server can take back in the history: an id, a name, and arguments that parse (a reply cut
// by max tokens or stop may end inside one).
function completeCall(call) {
  if (!call || !call.id || !call.function || !call.function.name) return false;
  try {
    JSON.parse(call.function.arguments);
    return true;
  } catch {
    return false;
  }
}

// The calls of the last message when it is a finished assistant turn with tool calls (nothing answers them yet).
function pendingCalls() {
  const last = state.messages[state.messages.length - 1];
  return last && last.role === "assistant" && last.state === "done" && last.tool_calls && last.tool_calls.length
    ? last.tool_calls.filter(completeCall) : [];
}

// A box per pending call for its result, and a button that sends them as `role: "tool"` messages.
function resultsForm(calls) {
  const form = element("div", "tool-results");
  for (const call of calls) {
    const label = element("label", "", `Result of ${call.function.name}`);
    const box = element("textarea", "tool-result");
    box.rows = 2;
    box.dataset.callId = call.id;
    box.placeholder = "what the tool returned, e.g. JSON";
    label.append(box);
    form.append(label);
  }
  const button = element("button", "tool-send", calls.length > 1 ? "Send tool results" : "Send tool result");
  button.type = "button";
  button.disabled = controller !== null;
  button.addEventListener("click", () => sendToolResults(form, calls));
  form.append(button);
  return form;
}

function renderAll() {
  const nodes = state.messages.map(messageNode);
  const calls = pendingCalls();
  if (calls.length) nodes[nodes.length - 1].append(resultsForm(calls));
  $("messages").replaceChildren(...nodes);
  scrollDown();
}

// The stored conversation as OpenAI messages: an assistant turn keeps its complete tool_calls (of a finished
// reply), tool results their tool_call_id.
function history() {
  const out = [];
  for (const m of state.messages) {
    if (m.state === "error") continue;
    if (m.role === "tool") {
      out.push({ role: "tool", tool_call_id: m.tool_call_id, content: m.content });
      continue;
    }
    const calls = m.role === "assistant" && m.state === "done" && m.tool_calls ? m.tool_calls.filter(completeCall) : [];
    if (!m.content && !calls.length) continue;
    const message = { role: m.role, content: m.content || null };
    if (calls.length) {
      message.tool_calls = calls.map((c) => ({
        id: c.id, type: "function", function: { name: c.function.name, arguments: c.function.arguments },
      }));
    }
    out.push(message);
  }
  return out;
}

function scrollDown() {
  const box = $("messages");
  box.scrollTop = box.scrollHeight;
}

function busy(on) {
  $("send").disabled = on;
  $("stop").disabled = !on;
  $("new-chat").disabled = on;
  for (const button of document.querySelectorAll(".tool-send")) button.disabled = on;
}

// The request body from the settings, or null after showing what is wrong (nothing is sent).
function requestBody() {
  showError("");
  try {
    return settings();
  } catch (err) {
    showError(err.message);
    return null;
  }
}

function send() {
  showError("");
  const text = $("prompt").value.trim();
  if (!text) {
    showError("type a message first");
    return;
  }
  const body = requestBody();
  if (!body) return;
  $("prompt").value = "";
  complete(body, [{ role: "user", content: text }]);
}

function sendToolResults(form, calls) {
  if (controller) return;
  const boxes = [...form.querySelectorAll(".tool-result")];
  const empty = boxes.find((box) => !box.value.trim());
  if (empty) {
    showError(`type the result of ${calls[boxes.indexOf(empty)].function.name} first`);
    empty.focus();
    return;
  }
  const body = requestBody();
  if (!body) return;
  complete(body, calls.map((call, i) => ({
    role: "tool", tool_call_id: call.id, name: call.function.name, content: boxes[i].value.trim(),
  })));
}

// Stores `added` (the user's message or tool results), then streams the assistant's reply to the whole conversation.
async function complete(body, added) {
  rememberSettings();
  const system = $("system").value.trim();
  state.messages.push(...added);
  const messages = [...(system ? [{ role: "system", content: system }] : []), ...history()];
  const reply = { role: "assistant", content: "", model: body.model, state: "streaming", meta: "waiting…" };
  if (body.response_format) reply.format = "json";
  state.messages.push(reply);
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
  const arrived = () => {
    if (firstAt === null) firstAt = performance.now();
    pieces += 1;
    reply.meta = "streaming…";
    if (!pending) {
      pending = true;
      setTimeout(paint, 40);
    }
  };
  try {
    const { usage, finishReason } = await streamChat({ ...body, messages }, {
      signal: controller.signal,
      onDelta: (delta) => {
        reply.content += delta;
        arrived();
      },
      onToolCall: (delta) => {
        const calls = reply.tool_calls || (reply.tool_calls = []);
        const at = Number.isInteger(delta.index) ? delta.index : calls.length;
        const call = calls[at] || (calls[at] = { id: "", type: "function", function: { name: "", arguments: "" } });
        if (delta.id) call.id = delta.id;
        if (delta.function && delta.function.name) call.function.name += delta.function.name;
        if (delta.function && delta.function.arguments) call.function.arguments += delta.function.arguments;
        arrived();
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
    const calls = pendingCalls();
    if (calls.length) node.append(resultsForm(calls)); // the reply made tool calls: ask for their results
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
  for (const [key, id] of Object.entries(SETTINGS)) {
    // The model is chosen once the list arrives (setModels); a select keeps only a value it offers.
    const value = state.settings[key];
    if (key === "model" || value === undefined) continue;
    if ($(id).type === "checkbox") $(id).checked = value === true;
    else if (typeof value === "string") $(id).value = value;
  }
  if (!$("response-format").value) $("response-format").value = "text";
  if (!$("tool-choice").value) $("tool-choice").value = "auto";
  showSchemaField();
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
  for (const id of Object.values(SETTINGS)) {
    $(id).addEventListener("change", rememberSettings);
    $(id).addEventListener("input", () => $(id).removeAttribute("aria-invalid"));
  }
  $("response-format").addEventListener("change", showSchemaField);
}
