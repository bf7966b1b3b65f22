"""Stage 07: the block KV allocator: KV memory in fixed-size blocks, handed out as sequences grow.

A contiguous cache per sequence must reserve the longest possible context up
front, and most of it is never used. minfer cuts the cache into blocks of
`block_size` token slots; a sequence gets a block only when it needs one, and
its *block table* (the list of its block ids, in order) says where each of its
tokens lives: slot = table[p // block_size] * block_size + p % block_size.

This script drives minfer.engine.block_allocator.BlockAllocator by hand (allocate, free,
share, free queue, ref counts), writes and reads a toy cache through block
tables, then sizes real KV tensors for the checkpoint's config (KVCache,
choose_num_blocks) and checks the engine frees every block it used.

    python tutorials/07_block_allocator.py   # MINFER_MODEL=/path to choose the checkpoint
    python tutorials/07_block_allocator.py --exercise   # with your allocate and free (tutorials/exercises/)
"""

import torch
from _common import exercise, model_path, section
from minfer.models.config import GPT2Config
from minfer.engine.block_allocator import BlockAllocator
from minfer.attention.cache_budget import choose_num_blocks
from minfer.attention.kv_cache import KVCache, cdiv, slot_of

from minfer import LLM, SamplingParams

graded = exercise("07")  # --exercise: your allocate and free (tutorials/exercises/) run instead
path = model_path()
cfg = GPT2Config.from_json(path)
fp32 = torch.float32
bytes_per_token = 2 * cfg.n_layer * cfg.n_embd * 4  # K and V, every layer, float32 (stage 03)


def blocks_for(num_tokens: int, block_size: int) -> int:
    return cdiv(num_tokens, block_size)  # ceil division: a partly filled block is still a block


section("why blocks: reserving the whole context per sequence wastes memory")
BLOCK_SIZE = 16
# Tokens 8 requests actually hold at some moment, given for GPT-2's 1024-token context and
# scaled to this checkpoint's: most requests use a small part of the context.
lengths = [max(1, n * cfg.n_positions // 1024) for n in (37, 120, 5, 300, 64, 17, 250, 90)]
assert max(lengths) <= cfg.n_positions
reserved = len(lengths) * cfg.n_positions  # a contiguous cache per sequence, sized for the worst case
in_blocks = sum(blocks_for(n, BLOCK_SIZE) for n in lengths) * BLOCK_SIZE  # whole blocks, allocated on demand
used = sum(lengths)
print(f"{len(lengths)} sequences holding {used} tokens ({bytes_per_token:,} bytes each):")
print(f"  {f'contiguous, {cfg.n_positions} slots reserved each:':<45}{reserved * bytes_per_token / 2**20:8.1f} MiB")
print(f"  {f'blocks of {BLOCK_SIZE} slots, allocated on demand:':<45}{in_blocks * bytes_per_token / 2**20:8.1f} MiB")
# A sequence never wastes more than the unused tail of its last block.
assert in_blocks - used < len(lengths) * BLOCK_SIZE
assert in_blocks < reserved

section("BlockAllocator: a free queue of block ids and a reference count per block")
BLOCK_SIZE, NUM_BLOCKS = 4, 10  # tiny, so every id can be printed
alloc = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)  # prefix caching is stage 09
tables: dict[str, list[int]] = {}  # request -> its block table
tokens: dict[str, list[int]] = {}  # request -> its token ids (made up: 100 + position for A, ...)


def append_tokens(name: str, n: int) -> None:
    """Add n tokens to a sequence, taking a new block whenever its last one is full
    (the same arithmetic as ContinuousBatcher.grow in minfer/engine/continuous_batcher.py)."""
    table, toks = tables.setdefault(name, []), tokens.setdefault(name, [])
    base = {"A": 100, "B": 200, "C": 300}[name]
    toks += [base + len(toks) + i for i in range(n)]
    need = blocks_for(len(toks), BLOCK_SIZE) - len(table)
    table += alloc.allocate(need)  # pops `need` ids off the front of the free queue


append_tokens("A", 6)  # A's prompt: 6 tokens -> 2 blocks
append_tokens("B", 3)  # B's prompt: 3 tokens -> 1 block
for _ in range(5):  # then both decode, one token a step, taking a block every BLOCK_SIZE tokens
    append_tokens("A", 1)
    append_tokens("B", 1)
for name in tables:
    print(f"{name}: {len(tokens[name]):2} tokens in blocks {tables[name]}")
print(f"free queue: {list(alloc.free_queue)}  ({alloc.num_free_blocks} free)")
assert tables == {"A": [0, 1, 4], "B": [2, 3]}  # interleaved growth: tables are not contiguous runs
assert all(len(tables[n]) == blocks_for(len(tokens[n]), BLOCK_SIZE) for n in tables)
assert alloc.num_free_blocks == NUM_BLOCKS - 5
alloc.check_invariants(list(tables.values()))  # ref counts match the live tables

section("slot mapping: token p of a sequence lives in slot table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE")


def slots_of(table: list[int], num_tokens: int) -> list[int]:
    return [slot_of(table, p, BLOCK_SIZE) for p in range(num_tokens)]  # the engine's own slot formula


# A toy "cache" that stores one number per slot instead of a key and a value vector.
store = torch.full((NUM_BLOCKS * BLOCK_SIZE,), -1)  # (num_slots,)
for name in tables:
    slots = slots_of(tables[name], len(tokens[name]))
    store[slots] = torch.tensor(tokens[name])  # write: scatter each token to its slot
    print(f"{name}: positions 0..{len(tokens[name]) - 1} -> slots {slots}")
for name in tables:
    gathered = store[slots_of(tables[name], len(tokens[name]))]  # read: gather through the table
    assert gathered.tolist() == tokens[name], "reading through the block table gives the sequence back"
assert not set(slots_of(tables["A"], 11)) & set(slots_of(tables["B"], 8)), "sequences never share a slot"

section("freeing: blocks go back to the free queue, and any free block will do")


def refused(n: int) -> str:
    """allocate(n) with fewer than n blocks free: the RuntimeError's sentence. It must take no block."""
    free_before = list(alloc.free_queue)
    try:
        alloc.allocate(n)
    except RuntimeError as e:
        assert list(alloc.free_queue) == free_before, "a refused allocate takes no block: check before taking any"
        return str(e)
    except Exception as e:
        raise AssertionError(f"allocate({n}) with {len(free_before)} free must raise RuntimeError, not {e!r}") from e
    raise AssertionError(f"allocate({n}) with {len(free_before)} free must raise RuntimeError")


alloc.free(tables.pop("A"))  # A finished: drop its references
print(f"A freed; free queue: {list(alloc.free_queue)}")
# Freed in reverse (tail first) and appended: never-used blocks are handed out before A's old ones.
assert list(alloc.free_queue) == [5, 6, 7, 8, 9, 4, 1, 0], "free walks a table in reverse, to the queue's back"
print(f"allocate(9) with 8 free -> RuntimeError: {refused(9)}")
append_tokens("C", 30)  # 30 tokens -> 8 blocks: every free block, wherever it is
print(f"C: 30 tokens in blocks {tables['C']}")
assert tables["C"] == [5, 6, 7, 8, 9, 4, 1, 0] and alloc.num_free_blocks == 0
store[slots_of(tables["C"], 30)] = torch.tensor(tokens["C"])  # overwrites what A left behind
assert store[slots_of(tables["B"], 8)].tolist() == tokens["B"], "B's tokens are untouched"
print(f"allocate(1) with nothing free -> RuntimeError: {refused(1)}")
alloc.check_invariants(list(tables.values()))

section("reference counts: a block can belong to several tables")
shared = tables["B"][0]
alloc.share([shared])  # another holder of B's first block (stage 09 shares common prompt prefixes)
print(f"block {shared}: ref_count {alloc.blocks[shared].ref_count} after share()")
alloc.free(tables.pop("B"))  # B ends; its first block is still referenced once
assert alloc.blocks[shared].ref_count == 1 and shared not in alloc.free_queue
alloc.free([shared])  # the last holder lets go: now it is free
assert alloc.blocks[shared].ref_count == 0 and shared in alloc.free_queue
try:
    alloc.free([shared])
    raise AssertionError("a double free must be caught")
except RuntimeError as e:
    print(f"freeing it again -> RuntimeError: {e}")
alloc.free(tables.pop("C"))
assert alloc.num_free_blocks == NUM_BLOCKS
alloc.check_invariants([])

section(f"the real tensors for this checkpoint ({cfg.n_layer} layers, {cfg.n_head} heads x {cfg.head_dim})")
BLOCK_SIZE = 16
per_block = KVCache.bytes_per_block(cfg, BLOCK_SIZE, fp32)
assert per_block == BLOCK_SIZE * bytes_per_token
kv = KVCache(cfg, num_blocks=8, block_size=BLOCK_SIZE, device="cpu", dtype=fp32)
print(f"KVCache(num_blocks=8): k and v are each {tuple(kv.k.shape)} = (layers, slots, heads, head_dim)")
print(f"{per_block:,} bytes per block of {BLOCK_SIZE} tokens")
assert kv.k.shape == kv.v.shape == (cfg.n_layer, (8 + 1) * BLOCK_SIZE, cfg.n_head, cfg.head_dim)
# One extra block, never handed out: padded reads in stage 08 point at it, so it must hold zeros.
assert kv.null_block == 8 and not kv.k[:, 8 * BLOCK_SIZE :].any() and not kv.v[:, 8 * BLOCK_SIZE :].any()
assert 2 * kv.k.numel() * kv.k.element_size() == 9 * per_block

section("choose_num_blocks: how many blocks a memory budget buys")
cpu = torch.device("cpu")
per_seq = blocks_for(cfg.n_positions, BLOCK_SIZE)  # blocks one full-length sequence needs
budget = int(3.5 * per_seq * per_block)  # room for three and a half full-length sequences
n = choose_num_blocks(cfg, BLOCK_SIZE, fp32, cpu, max_num_seqs=64, memory_bytes=budget)
print(f"{budget / 2**20:.1f} MiB -> {n} blocks ({n * BLOCK_SIZE} token slots; a full sequence needs {per_seq} blocks)")
assert n == budget // per_block
# Never more than every running sequence at full length could use, twice over (the rest keeps prefixes).
n1 = choose_num_blocks(cfg, BLOCK_SIZE, fp32, cpu, max_num_seqs=1, memory_bytes=budget)
print(f"same budget, max_num_seqs=1 -> {n1} blocks (capped at 2 x {per_seq})")
assert n1 == 2 * per_seq
try:
    choose_num_blocks(cfg, BLOCK_SIZE, fp32, cpu, max_num_seqs=64, memory_bytes=per_block * (per_seq - 1))
    raise AssertionError("a budget below one full sequence must be refused")
except ValueError as e:
    print(f"too small a budget -> ValueError: {e}")
auto = choose_num_blocks(cfg, BLOCK_SIZE, fp32, cpu, max_num_seqs=64)  # default: a quarter of free RAM on CPU
print(f"default budget on this machine: {auto} blocks = {auto * per_block / 2**20:.0f} MiB")
assert per_seq <= auto <= 2 * 64 * per_seq

section("the engine builds the same pieces, and gives every block back")
# OnlineScheduler.__init__ (minfer/engine/scheduler.py) sizes the cache with choose_num_blocks unless told
# num_kv_blocks, then builds a BlockAllocator and a KVCache; stage 10 is about that scheduler.
llm = LLM(path, num_kv_blocks=40, max_num_seqs=4)
sched = llm.scheduler
assert sched.allocator.num_blocks == 40 and sched.kv_cache.k.shape[1] == 41 * sched.block_size
# One prompt twice in a step: both compute the same blocks, and the second copy of each is a twin that
# prefix caching (stage 09) cannot find, so free must forget its hash (check_invariants asserts it).
outs = llm.generate(["The cat sat on the", "Once upon a time", "Once upon a time"],
                    SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False)
print(f"generated {[len(o.token_ids) for o in outs]} tokens; stats: {llm.stats()}")
assert llm.stats()["num_kv_blocks_free"] == 40, "finished requests must free every block"
allocator = sched.allocator
assert all(b.ref_count or b.hash is None or allocator.cached.get(b.hash) == b.block_id for b in allocator.blocks), (
    "a freed block whose hash the index does not point at (a twin) must forget its hash: no one can find it")
sched.check_invariants()
assert allocator.cached, "the full blocks stay findable after their requests end (stage 09)"
num_cached = len(allocator.cached)
everything = allocator.allocate(40)  # a block handed out again is overwritten: its cached prefix is evicted
print(f"allocate(40) takes every block and evicts the cached prefixes: {num_cached} indexed before, none after")
assert not allocator.cached and all(allocator.blocks[b].hash is None for b in everything), (
    "allocate evicts what a reused block cached: its hash, and the index entry pointing at it")
allocator.free(everything)
sched.check_invariants()
graded.graded()
print("\nOK: blocks on demand, scattered tables, slot arithmetic, ref counts, cache sizing, no leak.")
