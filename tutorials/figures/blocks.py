"""Figures of KV blocks, each drawn from the state minfer's own objects are left in (stages 07, 08, 09, 16).

Every function runs the real code (BlockAllocator, TorchBackend.build_metadata, OnlineScheduler on
minfer-tiny), reads block tables, reference counts and slots back from it, and draws what it read.
"""

from __future__ import annotations

import random

import torch
from svg import CACHED, FAINT, FREE, NULL, SEQUENCE_COLOURS, SHARED, Svg

from minfer import LLM, SamplingParams
from minfer.attention.backend import StepLayout
from minfer.attention.kv_cache import cdiv, slot_of
from minfer.attention.torch_sdpa import TorchBackend
from minfer.engine.block_allocator import BlockAllocator

A, B, C, D = SEQUENCE_COLOURS[:4]
PLAIN = dict(dtype="float32", attention_backend="eager")  # the same engine on any CPU: no compile, no bf16


def block_row(svg: Svg, x, y, ids, fill, label, w=40, h=26, gap=4, top=None, bottom=None) -> dict[int, tuple]:
    """Blocks side by side: fill(id) and label(id) give each one's colour and text; top(id)/bottom(id)
    small captions. Returns each id's box (x, y, w, h), for arrows."""
    boxes = {}
    for i, b in enumerate(ids):
        bx = x + i * (w + gap)
        colour = fill(b)
        svg.rect(bx, y, w, h, fill=colour)
        svg.text(bx + w / 2, y + h / 2 + 4, label(b), size=11, anchor="middle", mono=True,
                 fill="#ffffff" if colour in (SHARED, NULL) else "#222222")
        if top:
            svg.text(bx + w / 2, y - 4, top(b), size=9, anchor="middle", fill=FAINT)
        if bottom:
            svg.text(bx + w / 2, y + h + 11, bottom(b), size=9, anchor="middle", fill=FAINT)
        boxes[b] = (bx, y, w, h)
    return boxes


def table_row(svg: Svg, x, y, name, ids, fills, w=34, h=22) -> list[tuple]:
    """A block table: its name, then its block ids in order, each box coloured by fills[i]."""
    svg.text(x, y + h / 2 + 4, name, size=12, bold=True)
    boxes = []
    for i, b in enumerate(ids):
        bx = x + 90 + i * (w + 3)
        svg.rect(bx, y, w, h, fill=fills[i])
        svg.text(bx + w / 2, y + h / 2 + 4, b, size=11, anchor="middle", mono=True,
                 fill="#ffffff" if fills[i] in (SHARED, NULL) else "#222222")
        boxes.append((bx, y, w, h))
    return boxes


def arrow_up(svg: Svg, src: tuple, dst: tuple, colour="#555555", bend=0.0) -> None:
    """From the top of box src to the bottom of box dst."""
    svg.curve(src[0] + src[2] / 2, src[1], dst[0] + dst[2] / 2, dst[1] + dst[3] + 2, bend=bend, stroke=colour, width=1)


# ---------------------------------------------------------------------------------------------------
def block_tables(out) -> None:
    """Stage 07: two sequences growing in turn on a 10-block allocator, then one freed."""
    size, num_blocks = 4, 10
    alloc = BlockAllocator(num_blocks, size, enable_prefix_caching=False)
    tables: dict[str, list[int]] = {"A": [], "B": []}
    lengths = {"A": 0, "B": 0}

    def grow(name: str, n: int) -> None:  # the arithmetic of ContinuousBatcher.grow
        lengths[name] += n
        tables[name] += alloc.allocate(cdiv(lengths[name], size) - len(tables[name]))

    grow("A", 6)
    grow("B", 3)
    for _ in range(5):
        grow("A", 1)
        grow("B", 1)
    owner = {b: name for name, table in tables.items() for b in table}
    free_before = list(alloc.free_queue)
    refs = {b: alloc.blocks[b].ref_count for b in range(num_blocks)}
    colour = {"A": A, "B": B}

    svg = Svg(760, 340, "Block tables and the free queue (stage 07)")
    svg.text(20, 24, "BlockAllocator(10 blocks of 4 slots): A has 11 tokens, B has 8, grown one token at a time, "
             "in turns", size=13, bold=True)
    # The cache: every block with its 4 slots, each slot showing which token of which sequence it holds.
    slot_w, gap, x0, y0 = 17, 5, 20, 58
    block_box = {}
    for b in range(num_blocks):
        bx = x0 + b * (4 * slot_w + gap)
        svg.text(bx + 2 * slot_w, y0 - 6, f"block {b}", size=10, anchor="middle")
        for s in range(size):
            name = owner.get(b)
            position = tables[name].index(b) * size + s if name else None
            used = name is not None and position < lengths[name]
            svg.rect(bx + s * slot_w, y0, slot_w, 24, fill=colour[name] if used else FREE, rx=0,
                     stroke="#999999" if not used else "#222222", width=0.7)
            if used:
                svg.text(bx + s * slot_w + slot_w / 2, y0 + 16, position, size=9, anchor="middle", mono=True)
        svg.text(bx + 2 * slot_w, y0 + 37, f"ref {refs[b]}", size=9, anchor="middle", fill=FAINT)
        block_box[b] = (bx, y0, 4 * slot_w, 24)
    svg.text(x0, y0 + 54, "each slot: which token position it holds; slot = table[p // 4] * 4 + p % 4", size=10,
             fill=FAINT, italic=True)
    # The tables, each box pointing up at its block.
    for row, name in enumerate(tables):
        boxes = table_row(svg, x0, 140 + row * 34, f"{name}'s table", tables[name], [colour[name]] * len(tables[name]))
        for box, b in zip(boxes, tables[name]):
            arrow_up(svg, box, block_box[b], colour=colour[name], bend=-12)
    # The free queue, then again after A is freed.
    svg.text(x0, 236, "free queue, front to back: allocate(n) pops from the front", size=12, bold=True)
    block_row(svg, x0, 244, free_before, lambda b: FREE, str)
    alloc.free(tables["A"])
    after = list(alloc.free_queue)
    svg.text(x0, 296, "after free(A's table): appended in reverse, so A's tail (4) is reused before its head (1, 0)",
             size=12, bold=True)
    block_row(svg, x0, 304, after, lambda b: A if b in tables["A"] else FREE, str)
    svg.save(out)


# ---------------------------------------------------------------------------------------------------
def paged_read(out) -> None:
    """Stage 08: a decode group of two sequences read through their block tables, padding to the null block."""
    size, num_blocks = 4, 16
    ids = list(range(num_blocks))
    random.Random(0).shuffle(ids)  # as stage 08's script: blocks handed out in no order
    lens = {"A": 11, "B": 9}  # context lengths, each decoding its last position: close enough for one group
    tables = {"A": ids[0:3], "B": ids[4:7]}
    layout = StepLayout(
        slot_mapping=torch.tensor([slot_of(tables["A"], 10, size), slot_of(tables["B"], 8, size)]),
        query_starts=[0, 1], query_lens=[1, 1], context_lens=[lens["A"], lens["B"]],
        block_tables=[tables["A"], tables["B"]], block_size=size, null_block=num_blocks,
    )
    (group,) = TorchBackend("cpu", torch.float32).build_metadata(layout).decode_groups
    grid, mask = group.slots.tolist(), group.mask[:, 0, 0].tolist()  # (S, L) slots and (S, L) valid
    owner = {b: name for name, table in tables.items() for b in table}
    colour = {"A": A, "B": B}

    svg = Svg(800, 380, "A paged read (stage 08)")
    svg.text(20, 24, "One decode step of A (11 tokens) and B (9 tokens): TorchBackend.build_metadata's decode group",
             size=13, bold=True)
    svg.text(20, 48, f"one layer's cache: {num_blocks} blocks of {size} slots, and the null block", size=11)
    cache = block_row(svg, 20, 58, list(range(num_blocks + 1)),
                      lambda b: NULL if b == num_blocks else colour[owner[b]] if b in owner else FREE,
                      lambda b: "null" if b == num_blocks else b, w=40, gap=4)
    for row, name in enumerate(tables):
        boxes = table_row(svg, 20, 124 + row * 30, f"{name}'s table", tables[name], [colour[name]] * len(tables[name]))
        for box, b in zip(boxes, tables[name]):
            arrow_up(svg, box, cache[b], colour=colour[name], bend=-10)
    # The slot grid: what one gather reads, a row per sequence, padded to the longest.
    y = 214
    svg.text(20, y - 8, f"group.slots (S={len(grid)}, L={len(grid[0])}): every context position's slot; "
             "group.mask hides the padding", size=12, bold=True)
    for row, name in enumerate(tables):
        svg.text(20, y + row * 32 + 17, name, size=12, bold=True)
        for p, s in enumerate(grid[row]):
            valid = mask[row][p]
            fill = colour[name] if valid else NULL
            svg.rect(50 + p * 42, y + row * 32, 38, 24, fill=fill, rx=0)
            svg.text(50 + p * 42 + 19, y + row * 32 + 16, s, size=10, anchor="middle", mono=True,
                     fill="#222222" if valid else "#ffffff")
    for p in range(len(grid[0])):
        svg.text(50 + p * 42 + 19, y + 2 * 32 + 10, f"p{p}", size=9, anchor="middle", fill=FAINT)
    padded = [p for p in range(len(grid[1])) if not mask[1][p]]
    last = (50 + padded[-1] * 42 + 38, y + 32 + 12)
    svg.curve(last[0], last[1], cache[num_blocks][0] + 20, 58 + 28, bend=40, stroke=NULL, width=1, dash="3 3")
    svg.text(last[0] + 24, y + 50, "B's padding reads the zeroed null block, not", size=10, fill=NULL, italic=True)
    svg.text(last[0] + 24, y + 64, "its own unwritten slots (a masked NaN still poisons)", size=10, fill=NULL,
             italic=True)
    svg.text(20, 312, "one gather: kv_cache[group.slots] (S, L, 2, H, D), keys and values together", size=11, mono=True)
    svg.text(20, 330, "then sdpa(q (S, H, 1, D), keys, values, attn_mask=group.mask (S, 1, 1, L)) → (S, H, D)",
             size=11, mono=True)
    svg.legend(20, 366, [(A, "A's slots"), (B, "B's slots"), (NULL, "padding: the null block's slot, masked"),
                         (FREE, "blocks nobody holds")])
    svg.save(out)


# ---------------------------------------------------------------------------------------------------
def shared_prefix(out) -> None:
    """Stage 09: two requests sharing a system prompt's cached blocks, while a third's blocks sit cached."""
    llm = LLM("minfer-tiny", num_kv_blocks=20, max_num_seqs=4, **PLAIN)
    sched, alloc = llm.scheduler, llm.scheduler.allocator
    size = sched.block_size
    words = llm.tokenizer.encode("You are a helpful assistant. Answer briefly, politely and truthfully. ")
    system = (words * 50)[: 3 * size + 2]  # 3 full blocks and 2 tokens
    questions = [llm.tokenizer.encode(q) for q in (" What is the capital of France?", " How many legs has a spider?",
                                                    " Why is the sky blue?")]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = sched.add_request(prompt_token_ids=system + questions[0], sampling_params=params)
    while sched.has_unfinished():
        sched.step()
    sched.pop_finished_ids()
    sched.pop_response(first)
    ids = [sched.add_request(prompt_token_ids=system + q, sampling_params=params) for q in questions[1:]]
    sched.step()  # both admitted: each finds the system prompt's blocks by hash
    seqs = {f"request {i + 2}": sched.requests[r].seq for i, r in enumerate(ids)}
    tables = {name: list(seq.block_table) for name, seq in seqs.items()}
    refs = [alloc.blocks[b].ref_count for b in range(alloc.num_blocks)]
    hits = {name: seq.num_cached_tokens for name, seq in seqs.items()}
    shared = [b for b in range(alloc.num_blocks) if refs[b] > 1]
    assert shared == sorted(tables["request 2"][:3]), (shared, tables)
    colours = dict(zip(tables, (B, C)))
    owner = {b: name for name, table in tables.items() for b in table if refs[b] == 1}

    def fill(b: int) -> str:
        if refs[b] > 1:
            return SHARED
        if b in owner:
            return colours[owner[b]]
        return CACHED if alloc.block_state(b) == "cached" else FREE

    svg = Svg(900, 330, "Shared prefix blocks (stage 09)")
    svg.text(20, 24, f"OnlineScheduler on minfer-tiny, {alloc.num_blocks} blocks of {size}: request 1 has finished, "
             "then requests 2 and 3 start with its system prompt", size=13, bold=True)
    svg.text(20, 46, "hᵢ = hash(hᵢ₋₁, the block's tokens): a full block's name covers every token before it",
             size=11, fill=SHARED)
    cache = block_row(svg, 20, 84, list(range(alloc.num_blocks)), fill, str, w=36, gap=7,
                      bottom=lambda b: f"ref {refs[b]}" if refs[b] else ("cached" if fill(b) == CACHED else ""))
    chain = tables["request 2"][:3]
    for i, b in enumerate(chain):
        bx = cache[b][0] + 18
        svg.text(bx, 72, f"h{i}", size=11, anchor="middle", mono=True, fill=SHARED, bold=True)
        if i:
            svg.line(cache[chain[i - 1]][0] + 28, 68, bx - 10, 68, stroke=SHARED, width=1, arrow=True)
    for row, (name, table) in enumerate(tables.items()):
        fills = [SHARED if refs[b] > 1 else colours[name] for b in table]
        boxes = table_row(svg, 20, 160 + row * 32, name, table, fills)
        for box, b in zip(boxes, table):
            arrow_up(svg, box, cache[b], colour=SHARED if refs[b] > 1 else colours[name], bend=-14)
        svg.text(300, 160 + row * 32 + 15, f"{hits[name]} prompt tokens from the cache (num_cached_tokens)", size=11)
    cached = [b for b in range(alloc.num_blocks) if fill(b) == CACHED]
    svg.text(20, 246, f"grey blocks {cached}: request 1's own full blocks, unreferenced but still hashed: they sit in "
             "the free queue,", size=11)
    svg.text(20, 262, "findable by a later request until allocate() evicts them, least recently freed first", size=11)
    svg.legend(20, 300, [(SHARED, "shared: ref 2, one copy in memory"), (B, "request 2's own"), (C, "request 3's own"),
                         (CACHED, "cached, free"), (FREE, "free")])
    svg.save(out)


# ---------------------------------------------------------------------------------------------------
def copy_on_write(out) -> None:
    """Stage 16: n = 4 completions of one prompt after their fork: full blocks shared, the partial one copied."""
    llm = LLM("minfer-tiny", num_kv_blocks=24, max_num_seqs=8, **PLAIN)
    sched, alloc = llm.scheduler, llm.scheduler.allocator
    size = sched.block_size
    copies: list[tuple[int, int]] = []
    copy_blocks = sched.kv_cache.copy_blocks
    sched.kv_cache.copy_blocks = lambda pairs: copies.extend(pairs) or copy_blocks(pairs)  # record, then copy
    words = llm.tokenizer.encode("Once upon a time there was a little fox who lived in the woods. ")
    prompt = (words * 60)[: 3 * size + 5]  # 3 full blocks and 5 tokens
    n = 4
    sched.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=8, temperature=1.0, seed=42,
                                                                                n=n, ignore_eos=True))
    while len(sched.running) < n:
        sched.step()
    tables = {f"choice {seq.index}": list(seq.block_table) for seq in sched.running}
    refs = [alloc.blocks[b].ref_count for b in range(alloc.num_blocks)]
    colours = dict(zip(tables, SEQUENCE_COLOURS))
    assert len(copies) == n - 1 and all(src == tables["choice 0"][3] for src, _ in copies), copies

    svg = Svg(800, 300, "Copy-on-write for n > 1 (stage 16)")
    svg.text(20, 24, f"One prompt of {len(prompt)} tokens ({len(prompt) // size} full blocks + {len(prompt) % size} "
             f"tokens), n = {n}: the tables right after the prefill step", size=13, bold=True)
    boxes = {}
    for row, (name, table) in enumerate(tables.items()):
        fills = [SHARED if refs[b] > 1 else colours[name] for b in table]
        boxes[name] = table_row(svg, 20, 50 + row * 40, name, table, fills, w=40, h=26)
        svg.text(420, 50 + row * 40 + 17,
                 "keeps the partial block and writes its next token there" if name == "choice 0"
                 else "its own copy of the partial block", size=11)
    src_box = boxes["choice 0"][3]
    for i, name in enumerate(list(tables)[1:]):
        dst = boxes[name][3]
        svg.curve(src_box[0] + src_box[2], src_box[1] + 13, dst[0] + dst[2], dst[1] + 13, bend=-(14 + 16 * i),
                  stroke="#555555", width=1, dash="4 3")
    svg.text(330, 120, "KVCache.copy_blocks:", size=10, italic=True, fill=FAINT)
    svg.text(330, 134, "its keys and values,", size=10, italic=True, fill=FAINT)
    svg.text(330, 148, "every layer", size=10, italic=True, fill=FAINT)
    shared = [b for b in range(alloc.num_blocks) if refs[b] > 1]
    used = alloc.num_blocks - alloc.num_free_blocks
    svg.text(20, 256, f"blocks {shared}: the prompt's full blocks, held once with ref {n}: {used} blocks in use, "
             f"where {n} separate requests would hold {n * len(tables['choice 0'])}", size=11)
    svg.legend(20, 286, [(SHARED, f"shared (ref {n})"), *[(colours[name], f"{name}'s own") for name in tables]])
    svg.save(out)
