// The page: tabs, the API-key box (shown when the server asks for a key), the model list, the status.

import { apiKey, getJSON, setApiKey } from "./api.js";
import { initChat, setModels } from "./chat.js";
import { initEngine, setEngineVisible } from "./engine.js";

const $ = (id) => document.getElementById(id);
const VIEWS = ["chat", "engine"];

function show(view) {
  if (!VIEWS.includes(view)) view = "chat";
  for (const v of VIEWS) {
    $(`view-${v}`).hidden = v !== view;
    $(`tab-${v}`).classList.toggle("active", v === view);
    $(`tab-${v}`).setAttribute("aria-selected", String(v === view));
  }
  setEngineVisible(view === "engine");
  if (location.hash !== `#${view}`) history.replaceState(null, "", `#${view}`);
}

function status(state, text) {
  const node = $("server-status");
  node.dataset.state = state;
  node.textContent = text;
  if (state === "auth") askForKey("This server needs an API key.");
}

function askForKey(message) {
  $("auth").hidden = false;
  $("auth-message").textContent = message || "";
}

async function loadModels() {
  try {
    const list = await getJSON("/v1/models");
    setModels(list.data || []);
    $("chat-error").textContent = "";
    if (apiKey()) $("auth-message").textContent = "";
  } catch (err) {
    setModels([]);
    $("chat-error").textContent = `could not load the model list: ${err.message}`;
  }
}

function init() {
  for (const v of VIEWS) $(`tab-${v}`).addEventListener("click", () => show(v));
  window.addEventListener("hashchange", () => show(location.hash.slice(1)));
  window.addEventListener("wllm:auth-required", (event) => askForKey(event.detail));
  window.addEventListener("wllm:key-changed", loadModels);
  $("api-key").value = apiKey();
  if (apiKey()) $("auth").hidden = false;
  $("auth").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("api-key").value.trim();
    if (!key) {
      $("auth-message").textContent = "type a key first";
      return;
    }
    setApiKey(key);
  });
  $("api-key-forget").addEventListener("click", () => {
    $("api-key").value = "";
    setApiKey("");
  });
  initChat();
  initEngine(status);
  show(location.hash.slice(1) || "chat");
  loadModels();
}

init();
