"""Stage 08b (optional): paged attention made fast on a CPU: a tile at a time, or compiled to read in place.

Stage 08 gathers a decode group's whole context, then attends: correct, and the plain backend's way on
any device. Part 1 here reads the context a tile of sequences at a time (the CPU's tiled backend) and
checks it against gathering everything at once; part 2 compiles a plain-torch function that indexes
the cache by block table, so the context is read where it lies and never gathered. Every timing is
interleaved across the variants and repeated; the medians are checked against what the chapter says,
and a note is printed where they disagree. Timings never fail the run.

    python tutorials/08b_cpu_attention.py   # MINFER_MODEL=/path to choose the checkpoint
"""

import math
import time

import torch
import torch.nn.functional as F
from _common import model_path, section
from _timing import BUSY_MACHINE, claim, interleaved, show

from minfer.assembly.selector import choose_attention_backend
from minfer.attention.kv_cache import cdiv, slot_of
from minfer.attention.torch_sdpa import DecodeGroup
from minfer.compiled.attention import paged_decode_attention, slots_to_blocks
from minfer.cpu.tiled_attention import tile_bytes
from minfer.models.config import GPT2Config

torch.manual_seed(0)
cfg = GPT2Config.from_json(model_path())
H, D = cfg.n_head, cfg.head_dim
scale = 1 / math.sqrt(D)
backend = choose_attention_backend("cpu", torch.float32, "eager")  # the CPU's eager backend: cpu_tiled
print(f"attention backend: {backend.name}")
ROUNDS = 7


def check(name: str, fast: torch.Tensor, reference: torch.Tensor) -> None:
    err = (fast - reference).abs().max().item()
    print(f"  {name:<44} max |difference| = {err:.1e}")
    torch.testing.assert_close(fast, reference, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------
section("part 1: reading the context a tile at a time (cpu/tiled_attention.py's ContextReader)")
BLOCK_SIZE = 16
# A decode step of many sequences: gather every context at once, then attend, and the gathered
# keys/values (tens of MB) go out to DRAM and come back. Gather a few sequences at a time and
# each tile is still in cache when sdpa reads it. Same result; only the memory traffic differs.
L = min(cfg.n_positions, 192) // BLOCK_SIZE * BLOCK_SIZE  # context length of each sequence
S = max(32, cdiv(4 * tile_bytes(), 2 * L * H * D * 4))  # sequences: keys+values of 4 tiles at least
num_blocks = S * L // BLOCK_SIZE
blocks = torch.randperm(num_blocks + 1)[:num_blocks].view(S, L // BLOCK_SIZE)  # (S, L / BLOCK_SIZE) scattered tables
grid = slot_of(blocks, torch.arange(L), BLOCK_SIZE)  # (S, L) slots
big_kv = torch.randn((num_blocks + 2) * BLOCK_SIZE, 2, H, D)  # (num_slots, 2, H, D): one layer's cache
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


def contiguous() -> torch.Tensor:
    return F.scaled_dot_product_attention(q_dec.unsqueeze(2), dense_k, dense_v, scale=scale).squeeze(2)


check("tiled read vs gather-everything", tiled(), gather_all())
per_tile = reader.seqs_per_tile(big_kv, L)
context_bytes = 2 * S * L * H * D * 4
print(
    f"  {S} sequences x {L} positions: {context_bytes / 1e6:.1f} MB of keys+values; a tile holds {per_tile} "
    f"sequences ({tile_bytes() / 2**20:.1f} MiB budget: a quarter of this CPU's last-level cache)"
)
assert reader.largest_buffer_bytes <= 2 * tile_bytes() < context_bytes, "buffers are bounded by a tile, not the batch"

with torch.inference_mode():
    timings = interleaved(
        {
            "gather everything, then sdpa": gather_all,
            "tiled: gather a tile, sdpa, next tile": tiled,
            "sdpa over already-contiguous K/V (the floor)": contiguous,
        },
        rounds=ROUNDS,
    )
show(timings)
claim(timings, "tiled: gather a tile, sdpa, next tile", "gather everything, then sdpa",
      "the tiled read beats gathering everything",
      "The tiles win by keeping the gathered context in the last-level cache; another process using "
      "that cache, or a context small enough to fit it anyway, takes the advantage away. " + BUSY_MACHINE)
print("  (bench.py --profile shows the same split for a real step)")

# ---------------------------------------------------------------------------------------
section("part 2: reading the cache in place, compiled (compiled/attention.py)")
# Eager torch cannot attend through a slot table: it must gather (and, in bf16, upcast) first.
# The same attention in plain torch, indexing the cache by block table, compiled with torch.compile:
# Inductor writes loops that read each key and value where they lie, upcast, score, and add into the
# softmax-weighted sum. The gathered context is never stored.
# The compiled backend's cache is laid out in blocks, and each block's keys are stored transposed,
# (H, D, BLOCK_SIZE) per head (kv_cache.py, layout "blocks"): the score q . k sums over D, and with
# a block's positions side by side the compiler scores BLOCK_SIZE positions at once, as plain vector
# multiply-adds. Over rows of slots, each position's score would end in a sum across one vector's
# lanes, the slow kind; that version ran about half as fast on a Zen 4.
lens = torch.full((S,), L)  # (S,): every sequence's context length (all L here: nothing padded)
big_blocks = slots_to_blocks(big_kv, BLOCK_SIZE)  # the same keys and values: (num_blocks, 2, H, D * BLOCK_SIZE)
compiled = torch.compile(paged_decode_attention, dynamic=True)
kv16, blocks16, q16 = big_kv.bfloat16(), big_blocks.bfloat16(), q_dec.bfloat16()
start = time.perf_counter()
with torch.inference_mode():
    in_place = compiled(q_dec, big_blocks, blocks, lens, scale, BLOCK_SIZE)
    compiled(q16, blocks16, blocks, lens, scale, BLOCK_SIZE)  # bf16 compiles once more
print(f"  compiled fp32 and bf16 in {time.perf_counter() - start:.1f} s (a second run reads Inductor's on-disk cache)")
check("compiled, read in place vs gather-everything", in_place, gather_all())
# Timed in both dtypes beside the tiled read. In bf16 the tiled read must gather and then upcast
# (two passes and a buffer); the compiled loop upcasts as it reads. In fp32 there is nothing to
# upcast: on a Zen 4 the engine's fp32 decode steps measured alike, so fp32 compiles only on AMX CPUs.
with torch.inference_mode():
    timings = interleaved(
        {
            "tiled (part 1), fp32": tiled,
            "tiled (part 1), bf16": lambda: backend.decode_attention(q16, kv16, group, scale),
            "compiled, read in place, fp32": lambda: compiled(q_dec, big_blocks, blocks, lens, scale, BLOCK_SIZE),
            "compiled, read in place, bf16": lambda: compiled(q16, blocks16, blocks, lens, scale, BLOCK_SIZE),
        },
        rounds=ROUNDS,
    )
show(timings)
claim(timings, "compiled, read in place, bf16", "tiled (part 1), bf16",
      "in bf16 the compiled read beats the tiled one",
      "The compiled loop wins by reading and upcasting in one pass where the tiled read gathers and then "
      "upcasts; a CPU without native bf16, or a machine busy enough to stall either, can erase that. "
      + BUSY_MACHINE)
print("  (one layer, its cache warm from the last round; bench.py --profile times all layers in a real step)")
print("  (the engine runs this backend on a CPU in bf16, and in fp32 with AMX, if it compiles: attention_backend auto)")
print("\nOK: the tiled and the compiled reads equal gathering everything; their timings are above.")
