// The server's API as the UI calls it: the same routes, headers and auth as any client.
// The API key lives in this browser's localStorage only and is sent as `Authorization: Bearer`.

const KEY_STORE = "wllm.apiKey";

export function apiKey() {
  return localStorage.getItem(KEY_STORE) || "";
}

export function setApiKey(key) {
  if (key) localStorage.setItem(KEY_STORE, key);
  else localStorage.removeItem(KEY_STORE);
  window.dispatchEvent(new CustomEvent("wllm:key-changed"));
}

export class APIError extends Error {
  constructor(status, message, code) {
    super(message);
    this.status = status;
    this.code = code || null;
  }
}

async function errorOf(response) {
  let message = `HTTP ${response.status} ${response.statusText}`.trim();
  let code = null;
  try {
    const body = await response.json();
    if (body && body.error) {
      message = body.error.message || message;
      code = body.error.code || null;
    }
  } catch {
    // not JSON: keep the status line
  }
  if (response.status === 401) {
    window.dispatchEvent(new CustomEvent("wllm:auth-required", { detail: message }));
  }
  return new APIError(response.status, message, code);
}

// fetch() with the key and JSON body; resolves to the Response of a 2xx, else throws APIError.
export async function request(path, { method = "GET", body, signal } = {}) {
  const headers = {};
  const key = apiKey();
  if (key) headers.Authorization = `Bearer ${key}`;
  if (body !== undefined) headers["Content-Type"] = "application/json";
  let response;
  try {
    response = await fetch(path, {
      method, headers, signal, cache: "no-store", credentials: "omit",
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (err) {
    if (err.name === "AbortError") throw err;
    throw new APIError(0, `cannot reach the server (${err.message})`);
  }
  if (!response.ok) throw await errorOf(response);
  return response;
}

export async function getJSON(path, options) {
  return (await request(path, options)).json();
}

// The `data:` events of a server-sent event stream as parsed JSON, up to `[DONE]`. An error event
// (`data: {"error": ...}`, e.g. at shutdown) throws an APIError.
export async function* events(response) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        for (const line of block.split("\n")) {
          if (!line.startsWith("data:")) continue;
          const payload = line.slice(5).trim();
          if (payload === "[DONE]") return;
          const event = JSON.parse(payload);
          if (event.error) throw new APIError(500, event.error.message || "stream error", event.error.code);
          yield event;
        }
      }
    }
  } finally {
    reader.cancel().catch(() => {});
  }
  throw new APIError(0, "the stream ended before [DONE]");
}

// Stream one chat completion; calls onDelta(text) for each piece of content and onToolCall(delta) for
// each `delta.tool_calls` entry ({index, id, function: {name, arguments}}, the id and name on a call's
// first entry, argument text after); resolves to {usage, finishReason}. Abort through `signal` (the
// server then aborts the engine request).
export async function streamChat(body, { signal, onDelta, onToolCall }) {
  const response = await request("/v1/chat/completions", {
    method: "POST", signal, body: { ...body, stream: true, stream_options: { include_usage: true } },
  });
  let usage = null;
  let finishReason = null;
  for await (const chunk of events(response)) {
    if (chunk.usage) usage = chunk.usage;
    for (const choice of chunk.choices || []) {
      if (choice.delta && choice.delta.content) onDelta(choice.delta.content);
      if (choice.delta && Array.isArray(choice.delta.tool_calls) && onToolCall) {
        for (const call of choice.delta.tool_calls) onToolCall(call);
      }
      if (choice.finish_reason) finishReason = choice.finish_reason;
    }
  }
  return { usage, finishReason };
}
