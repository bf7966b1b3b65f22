"""Stage 08: paged attention: attention that reads keys and values through block tables.

Part 1 calls minfer.attention.paged.paged_attention by hand, on a small cache
whose blocks are handed out in shuffled order, for every kind of row the engine
schedules: fresh prompts, single-token decodes (batched, padded, masked) and
a prompt continued in a later chunk. Each output is compared with
F.scaled_dot_product_attention over the same keys and values laid out
contiguously. Last, the attention backend builds the same metadata from a plain
description of the step (a StepLayout), the way the engine does it.

Part 2 reads a decode group's context a tile at a time (the CPU backend's way)
and checks it against gathering everything at once (the plain backend's way),
then times both against the floor. Who describes a real step (ModelRunner) comes
in stage 10, after the scheduler that decides the step.

    python tutorials/08_paged_attention.py   # MINFER_MODEL=/path to choose the checkpoint
"""

import math
import random
import time

import torch
import torch.nn.functional as F
from _common import model_path, section

from minfer.attention.kv_cache import cdiv, slot_of
from minfer.attention.backend import StepLayout
from minfer.attention.paged import paged_attention
from minfer.assembly.selector import choose_attention_backend
from minfer.attention.torch_sdpa import DecodeGroup, GatheredMetadata, PrefillChunk
from minfer.models.gpt2 import GPT2

torch.manual_seed(0)
path = model_path()
model = GPT2.from_pretrained(path)
cfg = model.config
H, D = cfg.n_head, cfg.head_dim
scale = 1 / math.sqrt(D)
# The engine picks one attention backend per model, from its device: on a CPU the compiled one
# (part 3) where it compiles. Parts 1 and 2 use the eager one, "cpu_tiled", whose steps we can see.
backend = choose_attention_backend("cpu", torch.float32, "eager")  # the gather-then-attend backend; part 3 compiles
print(f"attention backend: {backend.name}")


def check(name: str, paged: torch.Tensor, dense: torch.Tensor) -> None:
    err = (paged - dense).abs().max().item()
    print(f"  {name:<44} max |paged - dense| = {err:.1e}")
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------
section("part 1: paged_attention by hand, on a cache with shuffled blocks")
BLOCK_SIZE, NUM_BLOCKS = 4, 16
# (num_slots, 2, H, D): one layer's keys and values, each slot's key next to its value (one row per
# slot, so one gather reads both). The engine allocates it with torch.empty, whose memory may hold
# anything, NaN included; NaN here makes any read of a never-written slot show up.
kv_cache = torch.full(((NUM_BLOCKS + 1) * BLOCK_SIZE, 2, H, D), float("nan"))
NULL = NUM_BLOCKS  # the extra block no sequence owns, kept zeroed: padding reads it
kv_cache[NULL * BLOCK_SIZE :] = 0
ids = list(range(NUM_BLOCKS))
random.Random(0).shuffle(ids)  # a cache that has served for a while hands out blocks in no order
tables = {"A": ids[0:4], "B": ids[4:6]}  # A gets up to 16 tokens, B up to 8
LEN = {"A": 16, "B": 7}
print(f"block tables: {tables}")

# Every token's query, key and value, as the layer's c_attn would produce them.
q = {s: torch.randn(n, H, D) for s, n in LEN.items()}  # (L, H, D) per sequence
k = {s: torch.randn(n, H, D) for s, n in LEN.items()}
v = {s: torch.randn(n, H, D) for s, n in LEN.items()}


def dense(s: str) -> torch.Tensor:
    """The reference: causal attention over the sequence's contiguous K/V. Returns (L, H, D)."""
    qs, ks, vs = (t[s].transpose(0, 1) for t in (q, k, v))  # (H, L, D)
    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)


def slots(s: str, positions) -> torch.Tensor:
    table = tables[s]
    return torch.tensor([slot_of(table, p, BLOCK_SIZE) for p in positions])  # (len(positions),)


def step(rows: list[tuple[str, int, int]], meta: GatheredMetadata) -> torch.Tensor:
    """Flatten rows [(seq, start, end)] into (N, H, D) and run paged_attention on them."""
    pick = lambda t: torch.cat([t[s][a:b] for s, a, b in rows])  # noqa: E731  (N, H, D)
    meta.slot_mapping = torch.cat([slots(s, range(a, b)) for s, a, b in rows])  # (N,)
    return paged_attention(pick(q), pick(k), pick(v), kv_cache, meta, scale)  # (N, H, D)


print("step 1: two fresh prompts, A[0:10] and B[0:5], flattened into 15 rows")
meta = GatheredMetadata(None, backend, prefills=[PrefillChunk(0, 10, None, None), PrefillChunk(10, 15, None, None)])
out = step([("A", 0, 10), ("B", 0, 5)], meta)
check("A prefill (its own keys, causal)", out[0:10], dense("A")[0:10])
check("B prefill", out[10:15], dense("B")[0:5])
assert torch.equal(kv_cache[slots("A", range(10)), 0], k["A"][:10]), "keys were stored in A's slots"

print("step 2: one decode each, A position 10 and B position 5, batched in one group")
lens = [11, 6]  # context lengths, the new token included
L = max(lens)
padded = [t + [NULL] * (cdiv(L, BLOCK_SIZE) - len(t)) for t in (tables["A"][: cdiv(11, BLOCK_SIZE)], tables["B"])]
table_t = torch.tensor(padded)  # (S, max_blocks): short tables padded with the null block
pos = torch.arange(L)  # (L,)
grid = slot_of(table_t, pos, BLOCK_SIZE)  # (S, L): slot of every context position
valid = pos[None, :] < torch.tensor(lens)[:, None]  # (S, L): False on padding
mask = valid[:, None, None, :]  # (S, 1, 1, L), the shape sdpa broadcasts over heads and the query
# B's positions 6 and 7 fall in B's own last block, in slots nothing has written yet. The mask hides
# them, but a masked NaN still poisons the weighted sum (weight 0 * NaN = NaN): see for yourself.
meta = GatheredMetadata(None, backend, decode_groups=[DecodeGroup(torch.tensor([0, 1]), grid, mask)])
assert step([("A", 10, 11), ("B", 5, 6)], meta)[1].isnan().all(), "unwritten slots leak through the mask"
print("  padding that reads B's own unwritten slots gives NaN, masked or not; so padding reads the null block:")
grid = torch.where(valid, grid, NULL * BLOCK_SIZE)  # every padded position -> a zeroed slot
print(f"  slots (S, L) =\n{grid}")
meta.decode_groups = [DecodeGroup(torch.tensor([0, 1]), grid, mask)]
out = step([("A", 10, 11), ("B", 5, 6)], meta)  # the same step again: it rewrites the same keys
check("A decode (one query, 11 keys)", out[0], dense("A")[10])
check("B decode (one query, 6 keys + 5 padding)", out[1], dense("B")[5])

print("step 3: a mixed step: B decodes position 6 while A's prompt continues with positions 11..15")
ctx = torch.arange(16)  # (16,) A's context: positions 0..15
query_pos = torch.arange(11, 16)  # (5,)
chunk = PrefillChunk(1, 6, context_slots=slots("A", range(16)), mask=ctx[None, :] <= query_pos[:, None])
b_grid = slots("B", range(7))[None, :]  # (1, 7), nothing padded: no mask
meta = GatheredMetadata(None, backend, decode_groups=[DecodeGroup(torch.tensor([0]), b_grid, None)], prefills=[chunk])
out = step([("B", 6, 7), ("A", 11, 16)], meta)
check("B decode", out[0], dense("B")[6])
check("A chunk (5 queries over 16 cached keys)", out[1:6], dense("A")[11:16])

print("step 3 again, the engine's way: describe the step, and the backend builds the metadata")
layout = StepLayout(  # what ModelRunner.prepare hands the backend each step: per sequence, in row order
    slot_mapping=torch.cat([slots("B", [6]), slots("A", range(11, 16))]),  # (6,) where the new keys go
    query_starts=[0, 1],  # B's row, then A's five
    query_lens=[1, 5],
    context_lens=[7, 16],  # each sequence's length once the step is done
    block_tables=[tables["B"], tables["A"]],
    block_size=BLOCK_SIZE,
    null_block=NULL,
)
built = backend.build_metadata(layout)
assert torch.equal(built.decode_groups[0].slots, b_grid) and torch.equal(built.prefills[0].mask, chunk.mask)
assert torch.equal(built.prefills[0].context_slots, chunk.context_slots)
check("the same step from the built metadata", step([("B", 6, 7), ("A", 11, 16)], built), out)

# ---------------------------------------------------------------------------------------
section("part 2: reading the context a tile at a time (attention/cpu_tiled.py's ContextReader)")
BLOCK_SIZE = 16
# A decode step of many sequences: gather every context at once, then attend, and the gathered
# keys/values (tens of MB) go out to DRAM and come back. Gather a few sequences at a time and
# each tile is still in cache when sdpa reads it. Same result; only the memory traffic differs.
from minfer.cpu.tiled_attention import tile_bytes  # noqa: E402

L = min(cfg.n_positions, 192) // BLOCK_SIZE * BLOCK_SIZE  # context length of each sequence
S = max(32, cdiv(4 * tile_bytes(), 2 * L * H * D * 4))  # sequences: keys+values of 4 tiles at least
blocks = torch.randperm(S * L // BLOCK_SIZE + 1)[: S * L // BLOCK_SIZE].view(
    S, L // BLOCK_SIZE
)  # scattered block tables
grid = slot_of(blocks, torch.arange(L), BLOCK_SIZE)  # (S, L) slots
big_kv = torch.randn((S * L // BLOCK_SIZE + 2) * BLOCK_SIZE, 2, H, D)  # (num_slots, 2, H, D): one layer's cache
q_dec = torch.randn(S, H, D)
group = DecodeGroup(torch.arange(S), grid, None)


def gather_all() -> torch.Tensor:
    """The plain backend's way (torch_sdpa.py, on any device): gather the whole group, then attend."""
    kv = big_kv[grid]  # (S, L, 2, H, D), in fresh memory
    ks, vs = kv[:, :, 0].transpose(1, 2), kv[:, :, 1].transpose(1, 2)  # (S, H, L, D) each
    return F.scaled_dot_product_attention(q_dec.unsqueeze(2), ks, vs, scale=scale).squeeze(2)


tiled = lambda: backend.decode_attention(q_dec, big_kv, group, scale)  # noqa: E731  the CPU backend's way
reader = backend.reader  # the tiles' buffers, reused across layers and steps
dense_k = big_kv[grid, 0].transpose(1, 2).contiguous()  # (S, H, L, D)
dense_v = big_kv[grid, 1].transpose(1, 2).contiguous()
contiguous = lambda: F.scaled_dot_product_attention(q_dec.unsqueeze(2), dense_k, dense_v, scale=scale).squeeze(2)  # noqa: E731
check("tiled read vs gather-everything", tiled(), gather_all())
per_tile = reader.seqs_per_tile(big_kv, L)
context_bytes = 2 * S * L * H * D * 4
print(
    f"  {S} sequences x {L} positions: {context_bytes / 1e6:.1f} MB of keys+values; a tile holds {per_tile} "
    f"sequences ({tile_bytes() / 2**20:.1f} MiB budget: a quarter of this CPU's last-level cache)"
)
assert reader.largest_buffer_bytes <= 2 * tile_bytes() < context_bytes, "buffers are bounded by a tile, not the batch"


def best_ms(fn, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


with torch.inference_mode():
    timings = {
        "gather everything, then sdpa": best_ms(gather_all),
        "tiled: gather a tile, sdpa, next tile": best_ms(tiled),
        "sdpa over already-contiguous K/V (the floor)": best_ms(contiguous),
    }
for name, ms in timings.items():
    print(f"  {name:<46} {ms:7.2f} ms")
print("  (timings depend on the machine and its load; bench.py --profile shows the same split for a real step)")

print("\nOK: paged attention equals dense attention, gathered at once or a tile at a time.")

# ---------------------------------------------------------------------------------------
section("part 3: reading the cache in place, compiled (attention/compiled.py)")
# Eager torch cannot attend through a slot table: it must gather (and, in bf16, upcast) first.
# The same attention in plain torch, indexing the cache by block table, compiled with torch.compile:
# Inductor writes loops that read each key and value where they lie, upcast, score, and add into the
# softmax-weighted sum. The gathered context is never stored.
# The compiled backend's cache is laid out in blocks, and each block's keys are stored transposed,
# (H, D, BLOCK_SIZE) per head (kv_cache.py, layout "blocks"): the score q . k sums over D, and with
# a block's positions side by side the compiler scores BLOCK_SIZE positions at once, as plain vector
# multiply-adds. Over rows of slots, each position's score would end in a sum across one vector's
# lanes, the slow kind; that version ran about half as fast on a Zen 4.
from minfer.compiled.attention import paged_decode_attention  # noqa: E402
from minfer.compiled.attention import slots_to_blocks  # noqa: E402

lens = torch.full((S,), L)  # (S,): every sequence's context length (all L here: nothing padded)
big_blocks = slots_to_blocks(big_kv, BLOCK_SIZE)  # the same keys and values: (num_blocks, 2, H, D * BLOCK_SIZE)
compiled = torch.compile(paged_decode_attention, dynamic=True)
start = time.perf_counter()
with torch.inference_mode():
    in_place = compiled(q_dec, big_blocks, blocks, lens, scale, BLOCK_SIZE)
print(f"  compiled in {time.perf_counter() - start:.1f} s (a second run reads Inductor's on-disk cache)")
check("compiled, read in place vs gather-everything", in_place, gather_all())
# Timed in both dtypes beside the tiled read. In bf16 the tiled read must gather and then upcast
# (two passes and a buffer); the compiled loop upcasts as it reads. In fp32 there is nothing to
# upcast: on a Zen 4 the engine's fp32 decode steps measured alike, so fp32 compiles only on AMX CPUs.
kv16, blocks16, q16 = big_kv.bfloat16(), big_blocks.bfloat16(), q_dec.bfloat16()
with torch.inference_mode():
    print(f"  {'':<30}{'fp32':>10}{'bf16':>10}")
    for name, fn in (("tiled (part 2)", tiled), ("compiled: read in place, fused", compiled)):
        if fn is tiled:
            ms = [best_ms(tiled), best_ms(lambda: backend.decode_attention(q16, kv16, group, scale))]
        else:
            ms = [best_ms(lambda: compiled(q_dec, big_blocks, blocks, lens, scale, BLOCK_SIZE))]
            ms.append(best_ms(lambda: compiled(q16, blocks16, blocks, lens, scale, BLOCK_SIZE)))  # compiles once more
        print(f"  {name:<30}{ms[0]:>7.2f} ms{ms[1]:>7.2f} ms")
print("  (one layer, its cache warm from the last repeat; bench.py --profile times all layers in a real step)")
print("  (the engine runs this backend on a CPU in bf16, and in fp32 with AMX, if it compiles: attention_backend auto)")
