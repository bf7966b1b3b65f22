"""The block allocator and prefix-cache index, on their own."""

import random

import pytest
import torch

from minfer.attention.cache_budget import choose_num_blocks
from minfer.attention.kv_cache import KVCache, cdiv
from minfer.engine.block_allocator import BlockAllocator, block_hash
from minfer.models.config import GPT2Config


def test_allocate_share_free_counts():
    alloc = BlockAllocator(num_blocks=8, block_size=4)
    a = alloc.allocate(3)
    assert len(set(a)) == 3 and alloc.num_free_blocks == 5
    alloc.share(a[:2])
    assert [alloc.blocks[b].ref_count for b in a] == [2, 2, 1]
    alloc.free(a)
    assert alloc.num_free_blocks == 6  # a[2] is free again; a[0], a[1] still shared
    alloc.free(a[:2])
    assert alloc.num_free_blocks == 8
    with pytest.raises(RuntimeError, match="freed more often"):
        alloc.free([a[0]])
    with pytest.raises(RuntimeError, match="only 8 free"):
        alloc.allocate(9)
    alloc.check_invariants()


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


def test_randomized_allocator_keeps_its_invariants():
    """Long random runs of allocate / share (prefix hits) / register / free."""
    rng = random.Random(0)
    for trial in range(20):
        block_size = rng.choice([1, 2, 4])
        alloc = BlockAllocator(
            num_blocks=rng.randint(4, 40), block_size=block_size, enable_prefix_caching=trial % 4 != 0
        )
        live: list[tuple[list[int], list[int]]] = []  # (block table, tokens)
        for _ in range(400):
            op = rng.random()
            if op < 0.45:  # a new sequence: reuse a cached prefix, allocate the rest
                tokens = [rng.randint(0, 3) for _ in range(rng.randint(1, 6 * block_size))]
                hits = alloc.match_prefix(tokens)
                need = cdiv(len(tokens), block_size) - len(hits)
                if need + alloc.num_unreferenced(hits) > alloc.num_free_blocks:
                    with pytest.raises(RuntimeError):
                        alloc.allocate(alloc.num_free_blocks + 1)
                    continue
                free_before = alloc.num_free_blocks
                alloc.share(hits)
                table = hits + alloc.allocate(need)
                assert free_before - alloc.num_free_blocks == need + sum(
                    1 for b in hits if alloc.blocks[b].ref_count == 1
                )
                alloc.register_full_blocks(table, tokens, len(tokens))  # its full blocks are computed
                live.append((table, tokens))
            elif live:  # a sequence ends
                table, _ = live.pop(rng.randrange(len(live)))
                alloc.free(table)
            alloc.check_invariants([t for t, _ in live])
            for table, tokens in live:  # a live sequence's cached prefix really holds its tokens
                for b in alloc.match_prefix(tokens):
                    assert alloc.blocks[b].token_ids in {
                        tuple(tokens[i : i + block_size]) for i in range(0, len(tokens), block_size)
                    }
        for table, _ in live:
            alloc.free(table)
        assert alloc.num_free_blocks == alloc.num_blocks
        assert all(b.ref_count == 0 for b in alloc.blocks)
        alloc.check_invariants()


def test_cache_size_from_a_memory_budget():
    config = GPT2Config(vocab_size=512, n_positions=512, n_embd=64, n_layer=2, n_head=4)
    per_block = KVCache.bytes_per_block(config, 16, torch.float32)
    assert per_block == 2 * 2 * 16 * 64 * 4
    cpu = torch.device("cpu")
    assert choose_num_blocks(config, 16, torch.float32, cpu, max_num_seqs=64, memory_bytes=100 * per_block) == 100
    # Capped at what the sequences could ever use (2x for prefix reuse): 2 * 2 seqs * 32 blocks.
    assert choose_num_blocks(config, 16, torch.float32, cpu, max_num_seqs=2, memory_bytes=10**9) == 128
    assert choose_num_blocks(config, 16, torch.float32, cpu, max_num_seqs=2, memory_fraction=0.5) > 0
    with pytest.raises(ValueError, match="fewer than the 32 one full-length sequence needs"):
        choose_num_blocks(config, 16, torch.float32, cpu, max_num_seqs=2, memory_bytes=10 * per_block)


def test_decode_groups_bound_padding():
    from minfer.attention.torch_sdpa import group_by_length

    lens = [300, 20, 290, 25, 150, 18, 160]
    groups = group_by_length(lens)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        assert g == sorted(g)  # batch order inside a group
        padded, real = max(lens[i] for i in g) * len(g), sum(lens[i] for i in g)
        assert padded <= 1.25 * real
    assert len(groups) == 3  # ~300, ~155, ~20
    assert group_by_length([7] * 10) == [list(range(10))]  # equal lengths: one group, no padding
