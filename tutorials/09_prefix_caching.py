"""Stage 09: prefix caching: reuse the KV blocks of a prompt prefix the engine has already computed.

Part 1 drives the prefix index of minfer.engine.block_allocator.BlockAllocator by hand:
chained block hashes (register_full_blocks, match_prefix), sharing a hit (share),
cached blocks that outlive their request in the free queue, and least-recently-freed
eviction, tail before head.

Part 2 runs requests that share a long "system prompt" through the engine's
OnlineScheduler, with prefix caching on and off: the cache hit shows in
RequestOutput.num_cached_tokens and in the prefill tokens each step computes,
while the greedy output stays the same.

    python tutorials/09_prefix_caching.py   # MINFER_MODEL=/path to choose the checkpoint
    python tutorials/09_prefix_caching.py --exercise   # your register_full_blocks and match_prefix (exercises/)
"""

from _common import exercise, model_path, section
from _timing import BUSY_MACHINE, Timing, claim, show

from minfer import LLM, OnlineScheduler, SamplingParams
from minfer.engine.block_allocator import BlockAllocator, block_hash

# --exercise: your register_full_blocks and match_prefix (tutorials/exercises/) run instead of minfer's
graded = exercise("09")
# ---------------------------------------------------------------------------------------
section("part 1: the prefix index, by hand (blocks of 4 tokens)")
BLOCK_SIZE = 4
alloc = BlockAllocator(num_blocks=6, block_size=BLOCK_SIZE)  # enable_prefix_caching=True is the default
a = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]  # request A: 2 full blocks and 2 tokens
table_a = alloc.allocate(3)
# After each step the scheduler tells the allocator how many of A's tokens have their K/V computed.
# The allocator names each block that is now full by a hash chained over (the previous block's
# hash, its own tokens): so a block's name covers every token before it. All 10 are computed here.
alloc.register_full_blocks(table_a, a, num_computed_tokens=10)
h0, h1 = (alloc.blocks[b].hash for b in table_a[:2])  # the hashes live on the blocks, nowhere else
assert h0 == block_hash(None, (11, 12, 13, 14)) and h1 == block_hash(h0, (21, 22, 23, 24)), (
    "each full block's hash chains on the hash of the block before it (the first on None)")
assert alloc.blocks[table_a[2]].hash is None, "2 tokens of 4: a partial block is not full, not named"
print(f"A: tokens {a}, block table {table_a}, full blocks registered: {list(alloc.cached.values())}")

for probe in ([11, 12, 13, 14, 21, 22, 23, 24, 99], [11, 12, 13, 14, 21, 22, 23], [99, 12, 13, 14, 21, 22, 23, 24]):
    print(f"  match_prefix({probe}) -> {alloc.match_prefix(probe)}")
assert alloc.match_prefix([11, 12, 13, 14, 21, 22, 23, 24, 99]) == table_a[:2], "a hit chains as register does"
assert alloc.match_prefix([11, 12, 13, 14, 21, 22, 23]) == table_a[:1], "only full blocks count"
assert alloc.match_prefix(a[:8]) == table_a[:2], "8 tokens are 2 full blocks: the last one counts too"
# Same second block, different first: the chained hash differs, so no hit. That is right: a key
# or value at position 5 depends on every token before it, not just on its own block.
assert alloc.match_prefix([99, 12, 13, 14, 21, 22, 23, 24]) == []
# A hash is not the tokens: two blocks of different tokens can share one. Plant such a collision (other
# tokens' hash pointing at A's first block): the block's own tokens must turn the false hit away.
collision = block_hash(None, (99, 12, 13, 14))
alloc.cached[collision] = table_a[0]
print(f"  a planted hash collision: match_prefix([99, 12, 13, 14]) -> {alloc.match_prefix([99, 12, 13, 14])}")
assert alloc.match_prefix([99, 12, 13, 14]) == [], "a hit compares the block's tokens, never trusts a hash alone"
del alloc.cached[collision]
# The scheduler calls register_full_blocks after every step, so it names only what is new: the blocks named
# before keep their hashes, and their tokens are not read again. On a copy of A, given 2 more tokens (and, in
# place of the 8 it has named, tokens no correct call reads), only the third block gets a name.
copy = BlockAllocator(num_blocks=3, block_size=BLOCK_SIZE)
copy_table = copy.allocate(3)
copy.register_full_blocks(copy_table, a, num_computed_tokens=10)
copy.register_full_blocks(copy_table, [0] * 8 + a[8:] + [33, 34], num_computed_tokens=12)
assert [copy.blocks[b].hash for b in copy_table] == [h0, h1, block_hash(h1, (31, 32, 33, 34))], (
    "register_full_blocks renamed blocks it had named before, or did not chain the new one on them")

b = [11, 12, 13, 14, 21, 22, 23, 24, 41, 42, 43]  # request B: A's first 8 tokens, then its own
hits = alloc.match_prefix(b)
alloc.share(hits)  # B references A's blocks: no new memory, and their 8 tokens need no compute
table_b = hits + alloc.allocate(1)
print(
    f"B: tokens {b}, block table {table_b}: {len(hits) * BLOCK_SIZE} tokens reused, "
    f"{len(b) - len(hits) * BLOCK_SIZE} to compute"
)
assert table_b[:2] == table_a[:2] and [alloc.blocks[x].ref_count for x in table_a[:2]] == [2, 2]

section("part 1: cached blocks outlive their requests, and are evicted least recently freed first")
alloc.free(table_a)
alloc.free(table_b)  # B's tail block first, then its head: see allocator.free
print(f"both finished: free queue {list(alloc.free_queue)}, still cached: blocks {list(alloc.cached.values())}")
assert alloc.num_free_blocks == 6  # cached blocks count as free: they can always be reclaimed
assert alloc.match_prefix(b) == table_a[:2], "still findable after their requests ended"
other = alloc.allocate(4)  # an unrelated request: takes never-cached blocks before cached ones
print(f"an unrelated request takes {other}; prefix still cached: {alloc.match_prefix(b)}")
assert alloc.match_prefix(b) == table_a[:2]
evicted = alloc.allocate(1)  # memory is short: the oldest freed cached block goes, the prefix's tail
print(f"one more block -> {evicted} is evicted; match_prefix now {alloc.match_prefix(b)}")
assert evicted == [table_a[1]] and alloc.match_prefix(b) == table_a[:1]  # the head survives longest
alloc.free(other + evicted)
alloc.check_invariants([])

# ---------------------------------------------------------------------------------------
section("part 2: a shared system prompt through the engine")
path = model_path()
llm = LLM(path, num_kv_blocks=48, max_num_seqs=4)
BLOCK_SIZE = llm.scheduler.block_size
words = llm.tokenizer.encode("You are a helpful assistant. Answer briefly, politely and truthfully. ")
system = (words * 50)[: 3 * BLOCK_SIZE + 2]  # exactly 3 full blocks and 2 tokens: lengths are the same on any tokenizer
q1 = (llm.tokenizer.encode(" What is the capital of France?") * 10)[:10]
q2 = (llm.tokenizer.encode(" How many legs does a spider have?") * 10)[:12]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)  # exactly 8 tokens each


def run_alone(sched: OnlineScheduler, prompt: list[int]):
    """Run one request to the end; return its output, the prompt tokens computed, and the time
    of its first step (the prefill, which samples the first token)."""
    rid = sched.add_request(prompt_token_ids=prompt, sampling_params=GREEDY)
    prefill_tokens, first_step = 0, None
    while sched.has_unfinished():
        sched.step()
        prefill_tokens += sched.last_step.num_prefill_tokens
        first_step = first_step or sched.last_step.end - sched.last_step.start
    sched.pop_finished_ids()
    return sched.pop_response(rid), prefill_tokens, first_step


plain = OnlineScheduler(llm.model, llm.tokenizer, num_kv_blocks=48, max_num_seqs=4, enable_prefix_caching=False)
out1 = run_alone(llm.scheduler, system + q1)[0]
turn2 = system + q1 + out1.token_ids + q2  # a follow-up: the first exchange, then a new question
requests = [
    ("same system prompt, new question", system + q2),
    ("the very same request again", system + q1),
    ("a second turn of the first chat", turn2),
]
# What each should find cached, in whole blocks: the system prompt's 3 full blocks (the same request
# again too: the last token is never taken from the cache, its logits are needed to sample). The
# second turn also finds the first chat's generated tokens: all of them went through the model but
# the last one sampled, and the full blocks among those were registered.
expected = [3 * BLOCK_SIZE, 3 * BLOCK_SIZE, (len(system + q1) + GREEDY.max_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE]
print(
    f"first request: {len(system + q1)} prompt tokens ({len(system)} of them the system prompt), "
    f"computed in full; its {len(system + q1) + GREEDY.max_tokens - 1} computed tokens fill "
    f"{(len(system + q1) + GREEDY.max_tokens - 1) // BLOCK_SIZE} blocks, now cached"
)
print(f"{'':34} {'prompt':>6} {'cached':>6} {'computed':>8} {'(no cache)':>10}")
RUNS = 5  # each request runs 5 times on each scheduler, in turns: the prefill step's median is printed
prefill_steps = {"a hit's prefill step": [], "the full prefill step": []}
for (name, prompt), want in zip(requests, expected):
    out, computed, t_cached = run_alone(llm.scheduler, prompt)
    ref, computed_plain, t_plain = run_alone(plain, prompt)
    print(f"{name:34} {len(prompt):6} {out.num_cached_tokens:6} {computed:8} {computed_plain:10}")
    assert out.num_cached_tokens == want, f"{name}: {out.num_cached_tokens} tokens cached, {want} expected"
    assert ref.num_cached_tokens == 0 and not plain.allocator.cached, "with prefix caching off, nothing is named"
    assert computed == len(prompt) - want and computed_plain == len(prompt), "a hit skips prefill work"
    assert out.token_ids == ref.token_ids, "prefix caching must not change the output"
    for _ in range(RUNS - 1):  # the same request again finds the same blocks: timing only
        prefill_steps["a hit's prefill step"].append(run_alone(llm.scheduler, prompt)[2])
        prefill_steps["the full prefill step"].append(run_alone(plain, prompt)[2])
timings = {name: Timing(seconds) for name, seconds in prefill_steps.items()}
print("the prefill steps of those requests run again, in turns (the engine's own step times):")
show(timings, width=24)
claim(timings, "a hit's prefill step", "the full prefill step", "a hit's prefill step is the faster",
      "On a model this small a step's fixed cost (Python, one call per layer, the sampler) is most of it, so "
      "skipping 48 of 62 tokens saves little: the chapter says so. " + BUSY_MACHINE)
stats = llm.stats()
print(
    f"scheduler stats: prefix_cache_hit_tokens={stats['prefix_cache_hit_tokens']}, "
    f"free blocks {stats['num_kv_blocks_free']}/{stats['num_kv_blocks_total']}"
)
assert stats["prefix_cache_hit_tokens"] == RUNS * sum(expected)
assert stats["num_kv_blocks_free"] == 48, "cached blocks are free blocks: nothing is held"
llm.scheduler.check_invariants()
graded.graded()
print(
    "\nOK: chained hashes, shared blocks, LRU eviction tail first, and cache hits that skip prefill "
    "without changing the output."
)
