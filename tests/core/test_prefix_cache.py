"""Prefix caching (tutorial stage 09): the allocator's index of full blocks by chained hashes, on its own
(matches, LRU eviction, twin blocks, collisions, caching off), and in the engine: a hit gives the tokens a miss
gives, after a preemption and after a request finished too."""

import torch
from engine_checks import GREEDY, assert_all_free

from minfer import LLM, SamplingParams
from minfer.engine.block_allocator import BlockAllocator, block_hash


def test_prefix_match_and_lru_eviction():
    alloc = BlockAllocator(num_blocks=4, block_size=2)
    tokens = [1, 2, 3, 4, 5, 6, 7]
    table = alloc.allocate(4)
    alloc.register_full_blocks(table, tokens, num_computed_tokens=7)  # three full blocks are computed
    assert alloc.match_prefix(tokens) == table[:3]
    assert alloc.match_prefix([1, 2, 3, 9]) == table[:1]
    assert alloc.match_prefix([9, 2, 3, 4]) == []
    alloc.free(table)
    assert alloc.num_free_blocks == 4 and alloc.match_prefix(tokens) == table[:3]  # still cached
    # Freed tail-first: the unhashed last block goes first, then the deepest cached block.
    got = alloc.allocate(2)
    assert got == [table[3], table[2]]
    assert alloc.match_prefix(tokens) == table[:2]
    alloc.check_invariants([got])


def test_the_chain_grows_step_by_step_and_lives_on_the_blocks():
    """Registering after every step hashes only the new full blocks, chained on the ones before:
    the same names as registering all at once, with no chain state kept outside the blocks."""
    tokens = [5, 6, 7, 8, 9, 10, 11]
    once, steps = BlockAllocator(num_blocks=4, block_size=2), BlockAllocator(num_blocks=4, block_size=2)
    table = once.allocate(4)
    once.register_full_blocks(table, tokens, 7)
    assert steps.allocate(4) == table
    for computed in (1, 3, 4, 4, 6, 7):  # a chunked prefill, then decodes
        steps.register_full_blocks(table, tokens, computed)
    parent, want = None, []
    for i in range(3):
        parent = block_hash(parent, tuple(tokens[2 * i : 2 * i + 2]))
        want.append(parent)
    assert [steps.blocks[b].hash for b in table[:3]] == [once.blocks[b].hash for b in table[:3]] == want
    assert steps.match_prefix(tokens) == table[:3] and steps.blocks[table[3]].hash is None
    steps.check_invariants([table])


def test_twin_blocks_keep_the_chain_and_are_never_found():
    """Two sequences that compute the same prefix at the same time each fill their own blocks. The index
    keeps the first; the second's twins still chain its later blocks, and go back empty when freed."""
    alloc = BlockAllocator(num_blocks=8, block_size=2)
    a_tokens, b_tokens = [1, 2, 3, 4], [1, 2, 3, 4, 5, 6]
    a, b = alloc.allocate(2), alloc.allocate(3)  # admitted together: nothing was cached yet
    alloc.register_full_blocks(a, a_tokens, 4)
    alloc.register_full_blocks(b, b_tokens, 6)
    assert alloc.match_prefix(b_tokens) == a + b[2:]  # b's third block chained through its twins
    alloc.check_invariants([a, b])
    alloc.free(b)
    assert [alloc.block_state(x) for x in b] == ["free", "free", "cached"]
    alloc.free(a)
    assert alloc.match_prefix(b_tokens) == a + b[2:]
    alloc.check_invariants()


def test_hash_collision_is_caught_by_comparing_tokens(monkeypatch):
    monkeypatch.setattr("minfer.engine.block_allocator.block_hash", lambda parent, tokens: 7)  # everything collides
    alloc = BlockAllocator(num_blocks=2, block_size=2)
    [b] = alloc.allocate(1)
    alloc.register_full_blocks([b], [1, 2], 2)
    assert alloc.match_prefix([1, 2, 0]) == [b]
    assert alloc.match_prefix([3, 4, 0]) == []


def test_caching_off_never_matches():
    alloc = BlockAllocator(num_blocks=2, block_size=2, enable_prefix_caching=False)
    [b] = alloc.allocate(1)
    alloc.register_full_blocks([b], [1, 2], 2)
    assert alloc.match_prefix([1, 2, 3]) == [] and not alloc.cached


def test_prefix_cache_hit_gives_same_output(tiny_checkpoint):
    g = torch.Generator().manual_seed(5)
    prefix = torch.randint(0, 511, (150,), generator=g).tolist()
    first, second = prefix + [1, 2, 3], prefix + [4, 5]
    cached = LLM(tiny_checkpoint, num_kv_blocks=64)
    cached.generate([first], GREEDY, use_tqdm=False)
    hits_before = cached.stats()["prefix_cache_hit_tokens"]
    out = cached.generate([second], GREEDY, use_tqdm=False)[0]
    assert out.num_cached_tokens == 144 == cached.stats()["prefix_cache_hit_tokens"] - hits_before  # 9 blocks
    uncached = LLM(tiny_checkpoint, num_kv_blocks=64, enable_prefix_caching=False)
    assert out.token_ids == uncached.generate([second], GREEDY, use_tqdm=False)[0].token_ids
    assert uncached.stats()["prefix_cache_hit_tokens"] == 0
    # The same prompt again: everything but the last token comes from the cache.
    again = cached.generate([second], GREEDY, use_tqdm=False)[0]
    assert again.token_ids == out.token_ids and again.num_cached_tokens == 144
    assert_all_free(cached)


def test_prefix_hits_after_preemption_and_after_finishing(tiny_checkpoint):
    """The allocator alone hashes: the batcher hands it token ids and block tables, and a sequence keeps no
    chain state. So a preempted sequence finds the blocks it computed before, and a finished one's blocks,
    generated tokens included, serve the next turn of its chat."""
    import ast
    from pathlib import Path

    import minfer

    for path in Path(minfer.__file__).parent.rglob("*.py"):
        if path.name != "block_allocator.py":
            tree = ast.parse(path.read_text(encoding="utf-8"))
            attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
            names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
            assert not attrs & {"block_hash", "hash", "block_hashes", "blocks", "cached"}, path
            assert "block_hash" not in names, path
    g = torch.Generator().manual_seed(3)
    a, b = (torch.randint(0, 511, (40,), generator=g).tolist() for _ in range(2))
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    llm = LLM(tiny_checkpoint, num_kv_blocks=7, max_num_seqs=2)  # two 80-token sequences need 10 blocks
    first, second = llm.generate([a, b], params, use_tqdm=False)
    assert (first.num_preemptions, second.num_preemptions) == (0, 1)
    assert second.num_recompute_cached_tokens == 32, "re-admitted, it found the two blocks it had computed"
    assert second.num_cached_tokens == 0, "its first admission found nothing: the prompt's cached tokens"
    alone = LLM(tiny_checkpoint, num_kv_blocks=64, enable_prefix_caching=False)
    assert second.token_ids == alone.generate([b], params, use_tqdm=False)[0].token_ids
    turn = b + second.token_ids + [7]  # its 79 computed tokens filled 4 blocks
    short = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    out = llm.generate([turn], short, use_tqdm=False)[0]
    assert out.num_cached_tokens == 64 and out.token_ids == alone.generate([turn], short, use_tqdm=False)[0].token_ids
    assert_all_free(llm)


def test_cached_prompt_tokens_never_exceed_the_prompt_after_a_preemption(tiny_checkpoint):
    """A preempted sequence's recompute finds its own full blocks, generated tokens too: 32 tokens of a 20-token
    prompt. The prompt's cached tokens (usage, bench, prefix_cache_hit_tokens) stay those of its first admission;
    what the recompute was spared is counted apart."""
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 511, (20,), generator=g).tolist() for _ in range(3)]
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)  # 40 tokens each: 3 blocks
    llm = LLM(tiny_checkpoint, block_size=16, num_kv_blocks=8, max_num_seqs=4)
    prefix_hits, recompute_hits = llm.stats()["prefix_cache_hit_tokens"], llm.stats()["recompute_cache_hit_tokens"]
    outs = llm.generate(prompts, params, use_tqdm=False)
    preempted = [o for o in outs if o.num_preemptions]
    assert preempted and all(o.num_recompute_cached_tokens > len(o.prompt_token_ids) for o in preempted)
    assert all(o.num_cached_tokens <= len(o.prompt_token_ids) for o in outs)
    assert [o.num_cached_tokens for o in outs] == [0, 0, 0]  # three fresh prompts, admitted together
    stats = llm.stats()
    assert stats["prefix_cache_hit_tokens"] - prefix_hits == sum(o.num_cached_tokens for o in outs)
    assert stats["recompute_cache_hit_tokens"] - recompute_hits == sum(o.num_recompute_cached_tokens for o in outs)
    # Asked again, each prompt is served by the cache at admission: its full block, 16 of its 20 tokens.
    again = llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    assert [o.num_cached_tokens for o in again] == [16, 16, 16]
    assert all(o.num_recompute_cached_tokens == 0 for o in again)
    assert_all_free(llm)
