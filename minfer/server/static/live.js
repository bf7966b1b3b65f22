// The live view: reads /engine/events (SSE, through fetch so that it can send the API key)
// and draws the engine's state. Every message is a JSON list of events; see engine_events.py.
"use strict";

const $ = (id) => document.getElementById(id);
const STATE_OF = { f: "free", u: "used", c: "cached" };
const MAX_STEPS = 240;      // steps kept for the timeline
const MAX_LATENCIES = 1000; // finished requests kept for the histograms

const view = {
  cells: [],            // the block elements, by block id
  blockSize: 16,
  counts: { free: 0, used: 0, cached: 0 },
  tables: new Map(),    // running request id -> its block table
  running: [], waiting: [],
  steps: [],            // {step, prefill, decode, seqs, ms, preempted}
  step: 0, preemptions: 0,
  sampled: [],          // [client time (ms), tokens sampled] for tokens/s
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
  const grid = $("blocks");
  if (view.cells.length !== s.num_blocks) {
    grid.textContent = "";
    const fragment = document.createDocumentFragment();
    view.cells = [];
    for (let b = 0; b < s.num_blocks; b++) {
      const cell = document.createElement("i");
      cell.dataset.block = b;
      fragment.appendChild(cell);
      view.cells.push(cell);
    }
    grid.appendChild(fragment);
    sizeCells();
  }
  view.counts = { free: 0, used: 0, cached: 0 };
  for (let b = 0; b < s.num_blocks; b++) {
    const state = STATE_OF[s.blocks[b]];
    view.cells[b].dataset.state = state;
    view.counts[state]++;
  }
  view.tables = new Map(Object.entries(s.tables).map(([id, [, blocks]]) => [id, blocks]));
  view.running = s.running;
  view.waiting = s.waiting;
  $("kv-info").textContent = `${s.num_blocks} blocks of ${s.block_size} tokens · max ${s.max_num_seqs} seqs, ` +
    `${s.max_num_batched_tokens} tokens per step`;
  markMine();
}

function applyChanges(e, now) {
  const wasRunning = new Set(view.running.map((r) => r[0]));
  for (const [id, [offset, blocks]] of Object.entries(e.tables)) {
    if (offset === 0 || !view.tables.has(id)) view.tables.set(id, blocks.slice());
    else view.tables.get(id).push(...blocks);
  }
  const running = new Set(e.running.map((r) => r[0]));
  for (const id of view.tables.keys()) if (!running.has(id)) view.tables.delete(id);
  for (const [b, state] of Object.entries(e.blocks)) setBlock(+b, state);
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
    push(view.steps, { step: e.step, prefill: e.num_prefill_tokens, decode: e.num_decode_tokens, seqs: e.num_seqs,
                       ms: (e.end - e.start) * 1000, preempted: e.preempted.length }, MAX_STEPS);
    view.sampled.push([now, e.num_sampled]);
  }
}

function setBlock(b, state) {
  const cell = view.cells[b];
  if (!cell || cell.dataset.state === state) return;
  view.counts[cell.dataset.state]--;
  view.counts[state]++;
  cell.dataset.state = state;
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
  for (const cell of document.querySelectorAll("#blocks i.mine")) cell.classList.remove("mine");
  for (const b of view.tables.get(view.mine) || []) view.cells[b]?.classList.add("mine");
}

// ---- drawing (at most once per animation frame) ----------------------------------------

function render() {
  requestAnimationFrame(render);
  if (!view.dirty) return;
  view.dirty = false;
  $("stat-step").textContent = view.step;
  $("stat-running").textContent = view.running.length;
  $("stat-waiting").textContent = view.waiting.length;
  $("stat-used").textContent = view.counts.used;
  $("stat-cached").textContent = view.counts.cached;
  $("stat-free").textContent = view.counts.free;
  $("stat-preempt").textContent = view.preemptions;
  renderRequests();
  drawTimeline();
  drawHistogram($("hist-ttft"), view.ttft, "TTFT", $("cap-ttft"));
  drawHistogram($("hist-tpot"), view.tpot, "TPOT", $("cap-tpot"));
}

function updateRate() { // tokens/s over the last two seconds, also when the engine falls idle
  const now = performance.now();
  while (view.sampled.length && view.sampled[0][0] < now - 2000) view.sampled.shift();
  const tokens = view.sampled.reduce((sum, [, n]) => sum + n, 0);
  $("stat-tps").textContent = (tokens / 2).toFixed(0);
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

function fitCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  if (canvas.width !== Math.round(width * ratio)) canvas.width = Math.round(width * ratio);
  if (canvas.height !== Math.round(height * ratio)) canvas.height = Math.round(height * ratio);
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  ctx.clearRect(0, 0, width, height);
  return [ctx, width, height];
}

const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

function drawTimeline() {
  const [ctx, w, h] = fitCanvas($("timeline"));
  const steps = view.steps;
  if (!steps.length) return;
  const top = 12, plot = h - top - 4;
  const maxTokens = Math.max(1, ...steps.map((s) => s.prefill + s.decode));
  const maxMs = Math.max(0.001, ...steps.map((s) => s.ms));
  const maxSeqs = Math.max(1, ...steps.map((s) => s.seqs));
  const slot = w / MAX_STEPS, barW = Math.max(1, slot - 1);
  steps.forEach((s, i) => {
    const x = i * slot;
    // Square-root height: a 12-token decode stays visible beside a 512-token prefill.
    const total = Math.sqrt((s.prefill + s.decode) / maxTokens) * plot;
    const dh = s.decode ? (total * s.decode) / (s.prefill + s.decode) : 0, ph = total - dh;
    ctx.fillStyle = css("--decode"); ctx.fillRect(x, h - 4 - dh, barW, dh);
    ctx.fillStyle = css("--prefill"); ctx.fillRect(x, h - 4 - dh - ph, barW, ph);
    if (s.preempted) { ctx.fillStyle = css("--preempt"); ctx.fillRect(x, 0, barW, 6); }
    ctx.fillStyle = css("--seqs");
    ctx.fillRect(x + barW / 2 - 1, h - 4 - (s.seqs / maxSeqs) * plot - 1, 2, 2);
  });
  ctx.strokeStyle = css("--steptime"); ctx.lineWidth = 1; ctx.beginPath();
  steps.forEach((s, i) => {
    const x = i * slot + barW / 2, y = h - 4 - (s.ms / maxMs) * plot;
    if (i) ctx.lineTo(x, y); else ctx.moveTo(x, y);
  });
  ctx.stroke();
  const last = steps[steps.length - 1];
  $("timeline-info").textContent = `last step ${last.step}: ${last.prefill} prefill + ${last.decode} decode tokens, ` +
    `${last.seqs} seqs, ${last.ms.toFixed(1)} ms · scale: ${maxTokens} tokens, ${maxMs.toFixed(1)} ms, ${maxSeqs} seqs`;
}

function drawHistogram(canvas, values, name, caption) {
  const [ctx, w, h] = fitCanvas(canvas);
  if (!values.length) { caption.textContent = `${name}: no finished requests yet`; return; }
  const sorted = [...values].sort((a, b) => a - b);
  const pick = (q) => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
  const hi = Math.max(pick(0.99), 1e-3), bins = new Array(20).fill(0);
  for (const v of values) bins[Math.min(19, Math.floor((v / hi) * 20))]++;
  const top = Math.max(...bins), bw = w / 20;
  ctx.fillStyle = css("--decode");
  bins.forEach((n, i) => { const bh = (n / top) * (h - 4); ctx.fillRect(i * bw, h - bh, bw - 1, bh); });
  caption.textContent = `${name} (${values.length}): median ${pick(0.5).toFixed(1)} ms, p99 ${pick(0.99).toFixed(1)} ms; axis 0–${hi.toFixed(0)} ms`;
}

function sizeCells() { // cells as large as the panel allows, 3 to 24 px
  const grid = $("blocks"), n = Math.max(1, view.cells.length);
  const cell = Math.floor(Math.sqrt((grid.clientWidth * grid.clientHeight) / n)) - 1;
  document.documentElement.style.setProperty("--cell", `${Math.max(3, Math.min(24, cell))}px`);
}

// ---- hovering a block --------------------------------------------------------------------

$("blocks").addEventListener("mouseover", (ev) => {
  const b = ev.target.dataset && ev.target.dataset.block;
  if (b === undefined) return;
  const block = +b, holders = [];
  for (const [id, table] of view.tables) {
    const index = table.indexOf(block);
    if (index >= 0) holders.push(`request ${id} (tokens ${index * view.blockSize}–${(index + 1) * view.blockSize - 1})`);
  }
  const state = ev.target.dataset.state;
  $("hover").textContent = `block ${block}: ${state}` + (holders.length ? ` · held by ${holders.join(", ")}` :
    state === "cached" ? " · holds a prefix a later request can reuse" : "");
});

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

window.addEventListener("resize", () => { sizeCells(); view.dirty = true; });
setInterval(updateRate, 500);
requestAnimationFrame(render);
connect();
