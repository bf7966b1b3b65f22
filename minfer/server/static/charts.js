// Charts with axes for the live view: the step timeline and the latency histograms.
// Plain canvas 2D: each chart is cleared and drawn whole, at most once per animation frame.
"use strict";

const $ = (id) => document.getElementById(id);
const chartAxes = {}; // canvas id -> {axis: {unit, ticks}}: what each chart labelled (the tests read it)
const AXIS_FONT = "10px system-ui, sans-serif";

// Colours come from the CSS variables in live.css, read once.
const color = {};
for (const name of ["free", "used", "shared", "cached", "mine", "prefill", "decode", "steptime", "seqs", "preempt", "muted", "axis"]) {
  color[name] = getComputedStyle(document.documentElement).getPropertyValue(`--${name}`).trim();
}

// Gives the canvas as many device pixels as it has CSS pixels on screen and draws in CSS pixels.
// Returns [ctx, width, height, resized]; resizing a canvas clears it.
function sizeCanvas(canvas) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth, height = canvas.clientHeight;
  const w = Math.round(width * ratio), h = Math.round(height * ratio);
  const resized = canvas.width !== w || canvas.height !== h;
  if (resized) { canvas.width = w; canvas.height = h; }
  const ctx = canvas.getContext("2d");
  ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
  return [ctx, width, height, resized];
}

function clearCanvas(canvas) {
  const [ctx, w, h] = sizeCanvas(canvas);
  ctx.clearRect(0, 0, w, h);
  return [ctx, w, h];
}

// ---- scales and axes ----------------------------------------------------------------------

// The smallest m x 10^k at or above x, for m in `steps`: 1, 2, 5 for the distance between ticks,
// more of them for the top of an axis, so that the bars use most of the height.
function niceCeil(x, steps = [1, 2, 5, 10]) {
  const p = 10 ** Math.floor(Math.log10(Math.max(x, 1e-9)));
  return steps.find((m) => m * p >= x * (1 - 1e-9)) * p;
}
const axisTop = (x) => niceCeil(x, [1, 1.5, 2, 3, 4, 5, 6, 8, 10]);

function linearTicks(top, count, minStep = 0) { // 0 and round multiples up to top, about `count` of them
  const step = Math.max(niceCeil(top / count), minStep), ticks = [];
  for (let v = 0; v <= top * (1 + 1e-9); v += step) ticks.push(+v.toPrecision(6));
  return ticks;
}

// For a square-root axis: round values (1, 2, 5 x 10^k) at least minGap px apart, top down.
function sqrtTicks(top, height, minGap) {
  const ticks = [top];
  let last = height;
  for (let p = 10 ** Math.floor(Math.log10(top)); p >= 1; p /= 10) {
    for (const m of [5, 2, 1]) {
      const v = m * p, y = Math.sqrt(v / top) * height;
      if (v < top && last - y >= minGap && y >= minGap) { ticks.push(v); last = y; }
    }
  }
  ticks.push(0);
  return ticks.reverse();
}

const label = (v) => (v >= 10000 ? `${v / 1000}k` : `${v}`);

// A vertical axis at x: a tick and a label at each value, and the unit above them at the canvas edge.
// `y(v)` maps a value to a canvas y; side "left" puts labels left of x, "right" right of it.
function yAxis(ctx, x, y, ticks, unit, side, ink = color.muted) {
  ctx.font = AXIS_FONT; ctx.fillStyle = ink; ctx.strokeStyle = color.axis; ctx.lineWidth = 1;
  ctx.textAlign = side === "left" ? "right" : "left"; ctx.textBaseline = "middle";
  const dir = side === "left" ? -1 : 1;
  for (const v of ticks) {
    const ty = Math.round(y(v)) + 0.5;
    ctx.beginPath(); ctx.moveTo(x, ty); ctx.lineTo(x + 3 * dir, ty); ctx.stroke();
    ctx.fillText(label(v), x + 5 * dir, ty);
  }
  ctx.textBaseline = "bottom"; ctx.textAlign = side;
  ctx.fillText(unit, side === "left" ? 2 : ctx.canvas.clientWidth - 2, Math.min(...ticks.map(y)) - 5);
}

// A horizontal axis at canvas y from x0 to x1: a tick and a label at each [x, text] of `marks`,
// and the unit left of x0, under the vertical axis' labels.
function xAxis(ctx, y, x0, x1, marks, unit) {
  hline(ctx, x0, x1, y);
  ctx.font = AXIS_FONT; ctx.fillStyle = color.muted; ctx.textBaseline = "top";
  const width = ctx.canvas.clientWidth;
  for (const [x, text] of marks) {
    const tx = Math.round(x) + 0.5;
    ctx.beginPath(); ctx.moveTo(tx, y); ctx.lineTo(tx, y + 3); ctx.stroke();
    const half = ctx.measureText(text).width / 2; // keep the label inside the canvas
    ctx.textAlign = "center"; ctx.fillText(text, Math.min(Math.max(x, half), width - half), y + 4);
  }
  ctx.textAlign = "right"; ctx.fillText(unit, x0 - 8, y + 4);
}

function hline(ctx, x0, x1, y) {
  ctx.strokeStyle = color.axis; ctx.lineWidth = 1;
  ctx.beginPath(); ctx.moveTo(x0, Math.round(y) + 0.5); ctx.lineTo(x1, Math.round(y) + 0.5); ctx.stroke();
}

// ---- the step timeline --------------------------------------------------------------------

// Two lanes that share the step axis. Upper lane: one bar per step, prefill tokens on decode tokens
// (left axis, square-root scale, so a 12-token decode stays visible beside a 512-token prefill),
// and the step time as a line (right axis, ms). Lower lane: the sequences that ran in the step.
function drawTimeline(canvas, steps, maxSteps) {
  const [ctx, w, h] = clearCanvas(canvas);
  const left = 44, right = w - 44, top = 14, bottom = h - 18;
  const seqsH = 28, tokensBottom = bottom - seqsH - 16, tokensH = tokensBottom - top;
  if (!steps.length) { chartAxes[canvas.id] = {}; return; }
  const maxTokens = axisTop(Math.max(1, ...steps.map((s) => s.prefill + s.decode)));
  const maxMs = axisTop(Math.max(0.01, ...steps.map((s) => s.ms)));
  const maxSeqs = axisTop(Math.max(1, ...steps.map((s) => s.seqs)));
  const tokenY = (v) => tokensBottom - Math.sqrt(v / maxTokens) * tokensH;
  const msY = (v) => tokensBottom - (v / maxMs) * tokensH;
  const seqY = (v) => bottom - (v / maxSeqs) * seqsH;
  const slot = (right - left) / maxSteps, barW = Math.max(1, slot - 1);
  const xOf = (i) => left + (maxSteps - steps.length + i) * slot; // the newest step at the right

  steps.forEach((s, i) => {
    const x = xOf(i), yTotal = tokenY(s.prefill + s.decode);
    const yDecode = tokensBottom - (s.decode / (s.prefill + s.decode || 1)) * (tokensBottom - yTotal);
    ctx.fillStyle = color.decode; ctx.fillRect(x, yDecode, barW, tokensBottom - yDecode);
    ctx.fillStyle = color.prefill; ctx.fillRect(x, yTotal, barW, yDecode - yTotal);
    if (s.preempted) { ctx.fillStyle = color.preempt; ctx.fillRect(x, top - 8, barW, 6); }
    ctx.fillStyle = color.seqs; ctx.fillRect(x, seqY(s.seqs), barW, bottom - seqY(s.seqs));
  });
  ctx.strokeStyle = color.steptime; ctx.lineWidth = 1; ctx.beginPath();
  steps.forEach((s, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, xOf(i) + barW / 2, msY(s.ms)));
  ctx.stroke();

  const axes = {
    tokens: { unit: "tokens", ticks: sqrtTicks(maxTokens, tokensH, 12) },
    ms: { unit: "ms", ticks: linearTicks(maxMs, 3) },
    seqs: { unit: "seqs", ticks: [0, maxSeqs] },
    step: { unit: "step", ticks: [] },
  };
  hline(ctx, left, right, tokensBottom);
  yAxis(ctx, left - 2, tokenY, axes.tokens.ticks, "tokens", "left");
  yAxis(ctx, right + 2, msY, axes.ms.ticks, "ms", "right", color.steptime);
  yAxis(ctx, left - 2, seqY, axes.seqs.ticks, "seqs", "left", color.seqs);
  const every = niceCeil(Math.max(1, maxSteps / 5)); // a labelled tick every `every` steps
  const marks = [];
  steps.forEach((s, i) => { if (s.step % every === 0) marks.push([xOf(i) + barW / 2, `${s.step}`]); });
  axes.step.ticks = marks.map(([, text]) => +text);
  xAxis(ctx, bottom, left, right, marks, "step");
  chartAxes[canvas.id] = axes;
}

// ---- latency histograms -------------------------------------------------------------------

const BINS = 20;

// A histogram of values in ms: 20 bins from 0 to a round number at or above the 99th percentile
// (larger values are counted in the last bin). Returns a one-line summary for the caption.
function drawHistogram(canvas, values, name) {
  const [ctx, w, h] = clearCanvas(canvas);
  if (!values.length) { chartAxes[canvas.id] = {}; return `${name}: no finished requests yet`; }
  const sorted = [...values].sort((a, b) => a - b);
  const pick = (q) => sorted[Math.min(sorted.length - 1, Math.floor(q * sorted.length))];
  const hi = axisTop(Math.max(pick(0.99), 1e-3)), bins = new Array(BINS).fill(0);
  for (const v of values) bins[Math.min(BINS - 1, Math.floor((v / hi) * BINS))]++;
  const left = 34, right = w - 6, top = 14, bottom = h - 16;
  const maxCount = axisTop(Math.max(...bins));
  const xOf = (ms) => left + (ms / hi) * (right - left), yOf = (n) => bottom - (n / maxCount) * (bottom - top);
  const bw = (right - left) / BINS;
  ctx.fillStyle = color.decode;
  bins.forEach((n, i) => ctx.fillRect(left + i * bw, yOf(n), Math.max(1, bw - 1), bottom - yOf(n)));
  const axes = { ms: { unit: "ms", ticks: linearTicks(hi, 4) }, requests: { unit: "requests", ticks: linearTicks(maxCount, 3, 1) } };
  yAxis(ctx, left - 2, yOf, axes.requests.ticks, "requests", "left");
  xAxis(ctx, bottom, left, right, axes.ms.ticks.map((v) => [xOf(v), label(v)]), "ms");
  chartAxes[canvas.id] = axes;
  return `${name} (${values.length}): median ${pick(0.5).toFixed(1)} ms, p99 ${pick(0.99).toFixed(1)} ms`;
}
