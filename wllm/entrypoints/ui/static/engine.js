// The engine view: GET /v1/engine/stats every second into tiles and charts, and a burst of concurrent
// streaming requests that shows continuous batching at work.

import { events, getJSON, request } from "./api.js";
import { drawChart } from "./charts.js";
import { currentModel } from "./chat.js";

const $ = (id) => document.getElementById(id);
const CAPACITY = 120; // samples kept: two minutes at one a second
const POLL_MS = 1000;
const history = {
  running: [], waiting: [], tps: [], kvUsed: [], kvCached: [], kvTotal: [],
  ttft50: [], ttft99: [], itl50: [], itl99: [],
};
const recent = []; // [time, generation_tokens] of the last polls, for tokens/s over about 3 s
let visible = false;
let onStatus = () => {};
export let latest = null;

function push(name, value) {
  const values = history[name];
  values.push(value === undefined ? null : value);
  if (values.length > CAPACITY) values.shift();
}

const ms = (seconds) => (seconds === null || seconds === undefined ? null : seconds * 1000);

function latencies(p) {
  if (!p || !p.count) return "–";
  return [p.p50, p.p90, p.p99].map((s) => (s < 1 ? `${(s * 1000).toFixed(0)} ms` : `${s.toFixed(2)} s`)).join(" / ");
}

function record(stats) {
  // Tokens/s from the server's counter over about three seconds: per poll it would jump whenever a
  // poll is answered late, and the server's own figure averages over ten.
  recent.push([stats.time, stats.generation_tokens]);
  while (recent.length > 2 && stats.time - recent[1][0] >= 3) recent.shift();
  const [t0, g0] = recent[0];
  const tps = stats.time > t0
    ? Math.max(0, (stats.generation_tokens - g0) / (stats.time - t0)) : stats.tokens_per_second;
  latest = { ...stats, tokensPerSecondNow: tps };
  const kv = stats.kv_cache;
  push("running", stats.requests.running);
  push("waiting", stats.requests.waiting);
  push("tps", tps);
  push("kvUsed", kv.blocks_used);
  push("kvCached", kv.blocks_cached);
  push("kvTotal", kv.blocks_total);
  push("ttft50", ms(stats.ttft_s.p50));
  push("ttft99", ms(stats.ttft_s.p99));
  push("itl50", ms(stats.itl_s.p50));
  push("itl99", ms(stats.itl_s.p99));

  $("stat-running").textContent = stats.requests.running;
  $("stat-waiting").textContent = stats.requests.waiting;
  $("stat-swapped").textContent = stats.requests.swapped;
  $("stat-tps").textContent = tps.toFixed(1);
  $("stat-kv-used").textContent = kv.blocks_total === null
    ? `${(kv.usage * 100).toFixed(1)} %` : `${kv.blocks_used} / ${kv.blocks_total}`;
  $("stat-kv-cached").textContent = kv.blocks_cached === null ? "–" : kv.blocks_cached;
  $("stat-prefix").textContent = `${(stats.prefix_cache.hit_rate * 100).toFixed(1)} %`;
  const pre = stats.preemptions;
  $("stat-preemptions").textContent = `${pre.total}` + (pre.total ? ` (swap ${pre.swap}, recompute ${pre.recompute})` : "");
  $("stat-ttft").textContent = latencies(stats.ttft_s);
  $("stat-itl").textContent = latencies(stats.itl_s);
  $("stat-generated").textContent = stats.generation_tokens;
}

export function drawCharts() {
  if (!visible) return;
  drawChart($("chart-requests"), [
    { label: "running", color: "#2456c8", values: history.running },
    { label: "waiting", color: "#d9822b", values: history.waiting },
  ], { capacity: CAPACITY });
  drawChart($("chart-tps"), [{ label: "tokens/s", color: "#1b9e5a", values: history.tps }],
    { capacity: CAPACITY, digits: 1 });
  drawChart($("chart-kv"), [
    { label: "used", color: "#2456c8", values: history.kvUsed },
    { label: "cached", color: "#8e44ad", values: history.kvCached },
    { label: "total", color: "#999999", values: history.kvTotal, dashed: true },
  ], { capacity: CAPACITY });
  drawChart($("chart-ttft"), [
    { label: "p50", color: "#2456c8", values: history.ttft50 },
    { label: "p99", color: "#d9822b", values: history.ttft99, dashed: true },
  ], { capacity: CAPACITY });
  drawChart($("chart-itl"), [
    { label: "p50", color: "#2456c8", values: history.itl50 },
    { label: "p99", color: "#d9822b", values: history.itl99, dashed: true },
  ], { capacity: CAPACITY });
}

async function poll() {
  try {
    record(await getJSON("/v1/engine/stats"));
    onStatus(latest.healthy ? "ok" : "down", latest.healthy ? "engine running" : "engine down");
    drawCharts();
  } catch (err) {
    onStatus(err.status === 401 ? "auth" : "error", err.status === 401 ? "API key needed" : err.message);
  } finally {
    setTimeout(poll, POLL_MS);
  }
}

export function setEngineVisible(on) {
  visible = on;
  drawCharts();
}

// ------------------------------------------------------------------ fire N concurrent requests

const TOPICS = ["the sea", "a lighthouse", "autumn", "a robot", "the moon", "a city at night", "coffee", "mountains",
  "a library", "rain", "a cat", "trains", "the desert", "snow", "a garden", "stars"];
let burst = null; // the AbortController of the running burst

function fireLimits() {
  const n = Number($("fire-n").value);
  const maxTokens = Number($("fire-max-tokens").value);
  if (!Number.isInteger(n) || n < 1 || n > 64) throw new Error(`requests must be a whole number from 1 to 64, got "${$("fire-n").value}"`);
  if (!Number.isInteger(maxTokens) || maxTokens < 1 || maxTokens > 4096) {
    throw new Error(`max tokens must be a whole number from 1 to 4096, got "${$("fire-max-tokens").value}"`);
  }
  return { n, maxTokens };
}

function lane(i, topic) {
  const row = document.createElement("div");
  row.className = "lane";
  row.dataset.state = "waiting";
  const label = document.createElement("span");
  label.className = "lane-label";
  label.textContent = `#${i + 1} ${topic}`;
  const bar = document.createElement("div");
  bar.className = "bar";
  const fill = document.createElement("div");
  fill.className = "fill";
  bar.append(fill);
  const info = document.createElement("span");
  info.className = "lane-info";
  info.textContent = "waiting";
  row.append(label, bar, info);
  return { row, fill, info };
}

// The N requests travel in one POST /v1/completions with N prompts (each the chat template applied to
// its message, from /tokenize): a browser opens at most 6 connections to one server, so N separate
// streams would queue in the browser, not in the engine. The server runs every prompt as its own
// engine request and streams them interleaved, each choice's `index` naming its prompt.
async function fire() {
  $("fire-error").textContent = "";
  let limits;
  try {
    limits = fireLimits();
  } catch (err) {
    $("fire-error").textContent = err.message;
    return;
  }
  const model = currentModel();
  if (!model) {
    $("fire-error").textContent = "no model to send to: the model list could not be loaded";
    return;
  }
  const { n, maxTokens } = limits;
  burst = new AbortController();
  $("fire-go").disabled = true;
  $("fire-abort").disabled = false;
  $("fire-summary").textContent = `preparing ${n} prompts…`;
  const lanes = [];
  $("lanes").replaceChildren();
  for (let i = 0; i < n; i++) {
    const l = lane(i, TOPICS[i % TOPICS.length]);
    l.tokens = 0;
    lanes.push(l);
    $("lanes").append(l.row);
  }
  let started = performance.now();
  try {
    const prompts = [];
    for (let i = 0; i < n; i++) {
      const content = `Write a short poem about ${TOPICS[i % TOPICS.length]}.`;
      const tokenized = await getJSON("/tokenize", {
        method: "POST", signal: burst.signal, body: { model, messages: [{ role: "user", content }] },
      });
      prompts.push(tokenized.tokens);
    }
    $("fire-summary").textContent = `${n} requests in flight…`;
    started = performance.now();
    const response = await request("/v1/completions", {
      method: "POST", signal: burst.signal,
      body: {
        model, prompt: prompts, max_tokens: maxTokens, temperature: 0.8, seed: 1, logprobs: 0, stream: true,
        stream_options: { include_usage: true },
      },
    });
    for await (const chunk of events(response)) {
      for (const choice of chunk.choices || []) {
        const l = lanes[choice.index];
        if (!l) continue;
        const got = choice.logprobs && choice.logprobs.tokens ? choice.logprobs.tokens.length : (choice.text ? 1 : 0);
        if (got && l.tokens === 0) {
          l.info.textContent = `first token after ${((performance.now() - started) / 1000).toFixed(2)} s`;
        }
        l.tokens += got;
        l.row.dataset.state = "streaming";
        l.fill.style.width = `${Math.min(100, (100 * l.tokens) / maxTokens)}%`;
        if (choice.finish_reason) {
          l.row.dataset.state = "done";
          l.fill.style.width = "100%";
          l.info.textContent = `${l.tokens} tokens in ${((performance.now() - started) / 1000).toFixed(2)} s` +
            (choice.finish_reason === "stop" ? " (ended by itself)" : "");
        }
      }
    }
  } catch (err) {
    for (const l of lanes) {
      if (l.row.dataset.state === "done") continue;
      l.row.dataset.state = err.name === "AbortError" ? "stopped" : "error";
      l.info.textContent = err.name === "AbortError" ? "aborted" : "failed";
    }
    if (err.name !== "AbortError") $("fire-error").textContent = err.message;
  } finally {
    const seconds = (performance.now() - started) / 1000;
    const tokens = lanes.reduce((a, l) => a + l.tokens, 0);
    const done = lanes.filter((l) => l.row.dataset.state === "done").length;
    $("fire-summary").textContent = `${done} of ${n} finished: ${tokens} tokens in ${seconds.toFixed(2)} s ` +
      `(${(tokens / Math.max(seconds, 1e-3)).toFixed(1)} tokens/s together)`;
    burst = null;
    $("fire-go").disabled = false;
    $("fire-abort").disabled = true;
  }
}

export function initEngine(statusCallback) {
  onStatus = statusCallback;
  const label = () => {
    const n = Number($("fire-n").value);
    $("fire-go").textContent = Number.isInteger(n) && n > 0 ? `Fire ${n} concurrent requests` : "Fire concurrent requests";
  };
  $("fire-n").addEventListener("input", label);
  label();
  $("fire").addEventListener("submit", (event) => {
    event.preventDefault();
    if (!burst) fire();
  });
  $("fire-abort").addEventListener("click", () => burst && burst.abort());
  window.addEventListener("resize", drawCharts);
  poll();
}
