// The live view: reads /engine/events (SSE, through fetch so that it can send the API key)
// and draws the engine's state. Every message is a JSON list of events; see engine_events.py.
// charts.js (the timeline and histograms) and blockmap.js (the KV block map) come before this file.
"use strict";

const MAX_STEPS = 240;      // steps kept for the timeline
const MAX_LATENCIES = 1000; // finished requests kept for the histograms

const view = {
  blockSize: 16,
  tables: new Map(),    // running request id -> its block table
  running: [], waiting: [], // after the latest event: the header counts these
  steps: [],            // {step, prefill, decode, seqs, finished, runningAfter, ms, preempted}
  step: 0, preemptions: 0,
  sampled: [],          // [client time (ms), step start, step end (engine s), tokens sampled] for tokens/s
  ttft: [], tpot: [],
  mine: null,           // the playground request's engine id
  dirty: false,
};
let apiKey = sessionStorage.getItem("minfer-api-key") || "";

// ---- the feed --------------------------------------------------------------------------

async function connect() {
  setStatus("connecting", "connecting…");
  let resp;
  try {
    resp = await fetch("/engine/events", { headers: authHeaders(), cache: "no-store" });
  } catch (e) {
    return retry("server unreachable");
  }
  if (resp.status === 401) {
    $("key-form").hidden = false;
    setStatus("key", apiKey ? "wrong API key" : "this server needs an API key");
    return;
  }
  if (!resp.ok) return retry(`HTTP ${resp.status}`);
  setStatus("live", "live");
  try {
    await readEvents(resp, onMessage);
  } catch (e) { /* the connection dropped: reconnect below */ }
  retry("disconnected");
}

// Calls onMessage(text) for every Server-Sent Events message of a fetch response, until it ends.
async function readEvents(resp, onMessage) {
  const reader = resp.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      onMessage(buffer.slice(0, end));
      buffer = buffer.slice(end + 2);
    }
  }
}

function retry(why) {
  setStatus("error", `${why}; retrying…`);
  setTimeout(connect, 2000);
}

function authHeaders() {
  return apiKey ? { Authorization: `Bearer ${apiKey}` } : {};
}

function setStatus(kind, text) {
  $("status").dataset.status = kind;
  $("status").textContent = text;
}

function onMessage(message) {
  const data = message.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5)).join("\n");
  if (!data) return; // a keep-alive comment
  const now = performance.now();
  for (const event of JSON.parse(data)) {
    if (event.type === "snapshot") applySnapshot(event);
    else applyChanges(event, now);
  }
  if (view.mine !== null) markMine();
  view.dirty = true;
}

// ---- applying events -------------------------------------------------------------------

function applySnapshot(s) {
  view.blockSize = s.block_size;
  view.step = s.step;
  resetBlocks(s.blocks);
  blockMap.shared = new Set();
  setSharedBlocks([], s.shared || []);
  view.tables = new Map(Object.entries(s.tables).map(([id, [, blocks]]) => [id, blocks]));
  view.running = s.running;
  view.waiting = s.waiting;
  $("kv-info").textContent = `${fmt(s.num_blocks)} blocks of ${s.block_size} tokens · max ${s.max_num_seqs} seqs, ` +
    `${s.max_num_batched_tokens} tokens per step`;
  markMine();
}

function applyChanges(e, now) {
  const wasRunning = new Set(view.running.map((r) => r[0]));
  for (const [id, [offset, blocks]] of Object.entries(e.tables)) {
    if (offset === 0 || !view.tables.has(id)) view.tables.set(id, blocks.slice());
    else { const table = view.tables.get(id); table.length = offset; table.push(...blocks); } // offset < length: copy-on-write
  }
  const running = new Set(e.running.map((r) => r[0]));
  for (const id of view.tables.keys()) if (!running.has(id)) view.tables.delete(id);
  for (const [b, state] of Object.entries(e.blocks)) setBlockState(+b, state);
  setSharedBlocks(Object.keys(e.blocks).map(Number), e.shared || []);
  view.running = e.running;
  view.waiting = e.waiting;
  view.step = e.step;
  for (const id of e.preempted) log("preempt", `step ${e.step}: request ${id} preempted; its blocks are freed and it will be recomputed`);
  for (const r of e.running) { // a request that joins with cached tokens is a prefix-cache hit
    if (!wasRunning.has(r[0]) && r[6] > 0 && r[2] <= r[1]) log("hit", `step ${e.step}: request ${r[0]} starts with ${r[6]} prompt tokens from the prefix cache`);
  }
  for (const [, ttft, tpot] of e.finished) {
    if (ttft !== null) push(view.ttft, ttft, MAX_LATENCIES);
    if (tpot !== null) push(view.tpot, tpot, MAX_LATENCIES);
  }
  view.preemptions += e.preempted.length;
  if (e.type === "step") {
    // num_seqs counts the sequences that ran in the step, those that finished in it too; e.running
    // (the header's count) those running after it, which also holds any the token budget left out.
    push(view.steps, { step: e.step, prefill: e.num_prefill_tokens, decode: e.num_decode_tokens, seqs: e.num_seqs,
                       finished: e.finished.length, runningAfter: e.running.length,
                       ms: (e.end - e.start) * 1000, preempted: e.preempted.length,
                       drafted: e.num_draft_tokens || 0, accepted: e.num_accepted_tokens || 0 }, MAX_STEPS);
    view.sampled.push([now, e.start, e.end, e.num_sampled]);
  }
}

function push(list, item, max) {
  list.push(item);
  if (list.length > max) list.splice(0, list.length - max);
}

function log(kind, text) {
  const li = document.createElement("li");
  li.className = kind;
  li.textContent = text;
  const ol = $("log");
  ol.prepend(li);
  while (ol.children.length > 60) ol.lastChild.remove();
}

function markMine() {
  setMineBlocks(view.tables.get(view.mine) || []);
}

// ---- drawing (at most once per animation frame) ----------------------------------------

function render() {
  requestAnimationFrame(render);
  if (!view.dirty) return;
  view.dirty = false;
  // The canvases first, then the text: a canvas' size read after the page's text changed would
  // make the browser lay out the page in the middle of the frame.
  drawBlockMap();
  drawTimeline($("timeline"), view.steps, MAX_STEPS);
  const ttft = drawHistogram($("hist-ttft"), view.ttft, "TTFT: time to first token");
  const tpot = drawHistogram($("hist-tpot"), view.tpot, "TPOT: time per output token");
  $("cap-ttft").textContent = ttft;
  $("cap-tpot").textContent = tpot;
  $("kv-summary").textContent = describeMap();
  $("timeline-info").textContent = describeStep(view.steps[view.steps.length - 1]);
  $("stat-step").textContent = view.step;
  $("stat-running").textContent = view.running.length;
  $("stat-waiting").textContent = view.waiting.length;
  $("stat-used").textContent = blockMap.counts[USED];
  $("stat-shared").textContent = blockMap.shared.size;
  $("stat-cached").textContent = blockMap.counts[CACHED];
  $("stat-free").textContent = blockMap.counts[FREE];
  $("stat-preempt").textContent = view.preemptions;
  renderRequests();
}

// The latest step in words. The sequences that ran in a step are not the header's "running": one
// that finished in the step ran but runs no more, and a running one that the token budget left out
// of the step did not run in it. So the caption gives both counts.
function describeStep(s) {
  if (!s) return "No steps yet.";
  return `step ${s.step}: ${s.seqs} seqs ran (${s.finished} finished in it), ${s.runningAfter} running after it; ` +
    `${s.prefill} prefill + ${s.decode} decode tokens in ${s.ms.toFixed(1)} ms` +
    (s.drafted ? `; speculation: ${s.accepted} of ${s.drafted} proposed tokens accepted` : "");
}

// Tokens/s of the steps that ended in the last two seconds of the engine's own clock, over the time those
// steps took: right from the first steps of a load, not diluted by a window they do not fill yet. Steps
// that arrived more than two seconds ago drop out, so an idle engine shows 0.
function updateRate() {
  const now = performance.now();
  while (view.sampled.length && view.sampled[0][0] < now - 2000) view.sampled.shift();
  if (!view.sampled.length) return ($("stat-tps").textContent = "0");
  const lastEnd = view.sampled[view.sampled.length - 1][2];
  const recent = view.sampled.filter(([, , end]) => end > lastEnd - 2);
  const tokens = recent.reduce((sum, [, , , n]) => sum + n, 0);
  const seconds = Math.max(lastEnd - recent[0][1], 0.1);
  $("stat-tps").textContent = (tokens / seconds).toFixed(0);
}

function renderRequests() {
  const rows = [];
  const shown = [...view.running.map((r) => [r, "running"]), ...view.waiting.map((r) => [r, "waiting"])];
  for (const [[id, prompt, computed, generated, maxTokens, preempted, cached], state] of shown.slice(0, 80)) {
    const promptDone = Math.min(computed, prompt);
    rows.push(`<tr class="${state}${id === view.mine ? " mine" : ""}" data-request="${id}"><td>${id}</td><td>${state}</td>` +
      `<td>${bar("prompt", promptDone / prompt)}${promptDone}/${prompt}</td>` +
      `<td>${bar("gen", generated / maxTokens)}${generated}/${maxTokens}</td><td>${preempted}</td><td>${cached}</td></tr>`);
  }
  document.querySelector("#requests tbody").innerHTML = rows.join("");
  $("requests-more").textContent = shown.length > 80 ? `… and ${shown.length - 80} more` :
    (shown.length ? "" : "No requests: send one from the playground.");
}

function bar(kind, fraction) {
  return `<span class="bar ${kind}"><span style="width:${Math.round(100 * Math.min(1, fraction))}%"></span></span>`;
}

// ---- API key -----------------------------------------------------------------------------

$("key-form").addEventListener("submit", (ev) => {
  ev.preventDefault();
  apiKey = $("key-input").value.trim();
  sessionStorage.setItem("minfer-api-key", apiKey);
  $("key-form").hidden = true;
  connect();
});

// ---- playground --------------------------------------------------------------------------

let playAbort = null;

$("play-form").addEventListener("submit", async (ev) => {
  ev.preventDefault();
  const out = $("play-out");
  out.textContent = "";
  playAbort = new AbortController();
  $("play-send").disabled = true;
  $("play-stop").disabled = false;
  try {
    const resp = await fetch("/v1/completions", {
      method: "POST",
      headers: { "Content-Type": "application/json", ...authHeaders() },
      body: JSON.stringify({ prompt: $("play-prompt").value, max_tokens: +$("play-max").value,
                             temperature: +$("play-temp").value, stream: true }),
      signal: playAbort.signal,
    });
    if (!resp.ok) {
      const body = await resp.json().catch(() => ({}));
      out.textContent = `error ${resp.status}: ${(body.error && body.error.message) || resp.statusText}`;
      return;
    }
    view.mine = resp.headers.get("X-Engine-Request-Id");
    markMine();
    await readEvents(resp, (message) => {
      const line = message.replace(/^data: ?/, "");
      if (line === "[DONE]") return;
      const chunk = JSON.parse(line);
      if (chunk.error) out.textContent += `\n[error: ${chunk.error.message}]`;
      for (const choice of chunk.choices || []) out.textContent += choice.text || "";
    });
  } catch (e) {
    if (e.name !== "AbortError") out.textContent += `\n[${e.message}]`;
  } finally {
    $("play-send").disabled = false;
    $("play-stop").disabled = true;
    playAbort = null;
  }
});

$("play-stop").addEventListener("click", () => playAbort && playAbort.abort());

window.addEventListener("resize", () => { view.dirty = true; });
setInterval(updateRate, 500);
requestAnimationFrame(render);
connect();
