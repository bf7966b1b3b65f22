// The KV block map. A real cache has thousands of blocks (5,111 by default on a 24 GB GPU) and a
// few hundred in use, so the map does two things:
//  - an overview bar draws the whole cache left to right, one column per group of blocks, so you
//    can see where the cache is busy;
//  - the map below it zooms to the region in use: one cell per block, as large as that region
//    allows (up to 24 px), and a line of text sums up the blocks outside it.
// Both are canvases. An event changes a few blocks, so only those cells are redrawn; the whole map
// is drawn again only when it zooms or the window is resized.
"use strict";

const FREE = 0, USED = 1, CACHED = 2;
const STATE_NAMES = ["free", "used", "cached"];
const STATE_OF_LETTER = { f: FREE, u: USED, c: CACHED }; // a snapshot's block letters
const MAX_CELL = 24, LEGIBLE_CELL = 6, GAP = 1; // px

const blockMap = {
  states: new Uint8Array(0), // block id -> FREE, USED or CACHED
  counts: [0, 0, 0],         // blocks in each state
  mine: new Set(),           // the playground request's blocks (drawn pink)
  shared: new Set(),         // used blocks held by several sequences: stored once (drawn dark blue)
  changed: new Set(),        // blocks to redraw at the next frame
  layout: null,              // which blocks the map shows, and how big: see fitLayout
  // Redraws so far: whole-map ones and changed-cells-only ones, cells drawn, and the ms they took
  // (the tests check that the count stays small; scripts/screenshot.py prints the times).
  drawn: { full: 0, partial: 0, cells: 0, fullMs: 0, partialMs: 0 },
};

// ---- state (called as events arrive) ----------------------------------------------------

function resetBlocks(letters) {
  blockMap.states = Uint8Array.from(letters, (l) => STATE_OF_LETTER[l]);
  blockMap.counts = [0, 0, 0];
  for (const s of blockMap.states) blockMap.counts[s]++;
  blockMap.layout = null; // a full redraw
}

function setBlockState(b, name) {
  const state = STATE_NAMES.indexOf(name), old = blockMap.states[b];
  if (old === undefined || old === state) return;
  blockMap.counts[old]--;
  blockMap.counts[state]++;
  blockMap.states[b] = state;
  blockMap.changed.add(b);
}

// `blocks`: the ids whose sharing may have changed; `shared`: those of them held by several sequences
// (all of the cache's, in a snapshot).
function setSharedBlocks(blocks, shared) {
  for (const b of blocks) if (blockMap.shared.delete(b)) blockMap.changed.add(b);
  for (const b of shared) { blockMap.shared.add(b); blockMap.changed.add(b); }
}

function setMineBlocks(blocks) {
  for (const b of blockMap.mine) blockMap.changed.add(b);
  blockMap.mine = new Set(blocks);
  for (const b of blockMap.mine) blockMap.changed.add(b);
}

// ---- which blocks the map shows ---------------------------------------------------------

// The first and last block the map must show: every block that is not free, if they fit at a
// legible cell size; once the cache has filled with cached prefixes they no longer do, and the map
// shows the blocks that running requests hold. null when there is nothing to show.
function neededRange(width, height) {
  const states = blockMap.states;
  let lo = -1, hi = -1, usedLo = -1, usedHi = -1;
  for (let b = 0; b < states.length; b++) {
    if (states[b] === FREE) continue;
    if (lo < 0) lo = b;
    hi = b;
    if (states[b] === USED) { if (usedLo < 0) usedLo = b; usedHi = b; }
  }
  if (lo < 0) return null;
  if (fitLayout(lo, hi, width, height).cell >= LEGIBLE_CELL || usedLo < 0) return [lo, hi];
  return [usedLo, usedHi];
}

// The layout with the largest cells (MAX_CELL px down to 1) at which the rows of blocks lo to hi fit
// in the canvas: `cols` cells a row, showing `count` blocks from block `first`, which starts lo's
// row (or an earlier one, so that the map does not end in empty rows past the end of the cache).
function fitLayout(lo, hi, width, height) {
  const n = blockMap.states.length;
  for (let cell = MAX_CELL; ; cell--) {
    const pitch = cell + GAP;
    const cols = Math.max(1, Math.floor((width + GAP) / pitch)), rows = Math.max(1, Math.floor((height + GAP) / pitch));
    const rowsNeeded = Math.floor(hi / cols) - Math.floor(lo / cols) + 1;
    if (rowsNeeded <= rows || cell === 1) {
      const firstRow = Math.max(0, Math.min(Math.floor(lo / cols), Math.ceil(n / cols) - rows));
      const first = firstRow * cols;
      return { cell, pitch, cols, first, count: Math.min(rows * cols, n - first), width, height };
    }
  }
}

// Zoom only when it must (a needed block is off the map) or when it can zoom in twice as far:
// a map that jumps on every event is hard to read.
function chooseLayout(width, height) {
  const old = blockMap.layout, range = neededRange(width, height) || [0, 0];
  const fresh = fitLayout(range[0], range[1], width, height);
  if (old && old.width === width && old.height === height && old.count > 0 &&
      range[0] >= old.first && range[1] < old.first + old.count && fresh.cell < 2 * old.cell) return old;
  return fresh;
}

// ---- drawing ----------------------------------------------------------------------------

function drawBlockMap() {
  if (!blockMap.states.length) return; // no snapshot yet
  const start = performance.now(), drawn = blockMap.drawn;
  const [ctx, width, height, resized] = sizeCanvas($("blocks"));
  const layout = chooseLayout(width, height);
  const full = resized || layout !== blockMap.layout;
  blockMap.layout = layout;
  if (full) {
    ctx.clearRect(0, 0, width, height);
    for (let b = layout.first; b < layout.first + layout.count; b++) drawCell(ctx, b);
    drawn.cells += layout.count;
  } else {
    for (const b of blockMap.changed) drawCell(ctx, b);
    drawn.cells += blockMap.changed.size;
  }
  blockMap.changed.clear();
  drawOverview();
  if (full) { drawn.full++; drawn.fullMs += performance.now() - start; }
  else { drawn.partial++; drawn.partialMs += performance.now() - start; }
}

function drawCell(ctx, b) {
  const rect = cellRect(b);
  if (!rect) return; // off the map
  const state = blockMap.states[b];
  ctx.fillStyle = blockMap.mine.has(b) ? color.mine :
    state === USED && blockMap.shared.has(b) ? color.shared : color[STATE_NAMES[state]];
  ctx.fillRect(rect[0], rect[1], rect[2], rect[2]);
}

// [x, y, size] of block b's cell on the map canvas (CSS px), or null if the map does not show it.
function cellRect(b) {
  const L = blockMap.layout, i = b - L.first;
  if (i < 0 || i >= L.count) return null;
  return [(i % L.cols) * L.pitch, Math.floor(i / L.cols) * L.pitch, L.cell];
}

function blockAt(x, y) { // the block under a point of the map canvas, or null
  const L = blockMap.layout;
  if (!L) return null;
  const col = Math.floor(x / L.pitch), row = Math.floor(y / L.pitch);
  const b = L.first + row * L.cols + col;
  return col < L.cols && x % L.pitch < L.cell && y % L.pitch < L.cell && b < L.first + L.count ? b : null;
}

// The overview bar: column x stands for the blocks from x*n/width on. It is drawn as a stacked
// bar: the share of those blocks in use (bottom), then the share cached, on a free background.
// A dark frame marks the blocks the map shows.
function drawOverview() {
  const [ctx, w, h] = clearCanvas($("kv-overview"));
  const states = blockMap.states, n = states.length, L = blockMap.layout;
  ctx.fillStyle = color.free; ctx.fillRect(0, 0, w, h);
  const columns = Math.min(w, n), colW = w / columns;
  for (let c = 0; c < columns; c++) {
    const lo = Math.floor((c * n) / columns), hi = Math.floor(((c + 1) * n) / columns);
    let used = 0, cached = 0;
    for (let b = lo; b < hi; b++) { used += states[b] === USED; cached += states[b] === CACHED; }
    if (!used && !cached) continue;
    const uh = (used / (hi - lo)) * h, ch = (cached / (hi - lo)) * h;
    ctx.fillStyle = color.used; ctx.fillRect(c * colW, h - uh, colW, uh);
    ctx.fillStyle = color.cached; ctx.fillRect(c * colW, h - uh - ch, colW, ch);
  }
  if (L && n) {
    ctx.strokeStyle = "#1d232b"; ctx.lineWidth = 2;
    ctx.strokeRect((L.first / n) * w + 1, 1, Math.max(2, (L.count / n) * w - 2), h - 2);
  }
}

const fmt = (v) => v.toLocaleString("en-US");

// A line above the map: which blocks it shows, at what size, and what the rest hold.
function describeMap() {
  const L = blockMap.layout, states = blockMap.states, n = states.length;
  if (!L) return "";
  const rest = [0, 0, 0];
  for (let b = 0; b < n; b++) if (b < L.first || b >= L.first + L.count) rest[states[b]]++;
  const outside = n - L.count;
  const restText = !outside ? "the map shows every block" :
    rest[FREE] === outside ? `the other ${fmt(outside)}: all free` :
      `the other ${fmt(outside)}: ${fmt(rest[USED])} used · ${fmt(rest[CACHED])} cached · ${fmt(rest[FREE])} free`;
  return `map: blocks ${fmt(L.first)}–${fmt(L.first + L.count - 1)} of ${fmt(n)}, ` +
    `${L.cell} px each; ${restText}`;
}

// ---- hovering a block -------------------------------------------------------------------

$("blocks").addEventListener("mousemove", (ev) => {
  const block = blockAt(ev.offsetX, ev.offsetY);
  if (block === null) return;
  const holders = [];
  for (const [id, table] of view.tables) {
    const index = table.indexOf(block);
    if (index >= 0) holders.push(`request ${id} (tokens ${index * view.blockSize}–${(index + 1) * view.blockSize - 1})`);
  }
  const state = STATE_NAMES[blockMap.states[block]] + (blockMap.shared.has(block) ? ", shared: stored once" : "");
  $("hover").textContent = `block ${block}: ${state}` + (holders.length ? ` · held by ${holders.join(", ")}` :
    state === "cached" ? " · holds a prefix a later request can reuse" : "");
});
