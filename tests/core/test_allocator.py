"""The block allocator (engine/block_allocator.py, tutorial stage 07) on its own: blocks allocated, shared and
freed by reference count, its invariants over long random runs, and how many blocks a memory budget buys."""

import random

import pytest
import torch

from minfer.attention.cache_budget import choose_num_blocks
from minfer.attention.kv_cache import KVCache, cdiv
from minfer.engine.block_allocator import BlockAllocator
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
            ids = range(alloc.num_blocks)  # the live view's one-pass snapshot says what the per-block calls say
            assert alloc.block_states() == [alloc.block_state(b) for b in ids]
            assert alloc.shared_block_ids() == [b for b in ids if alloc.is_shared(b)]
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
    # Never more than 32-bit indexing reaches in one layer's (slots, 2, Hkv, D): Qwen3-0.6B's 2 x 8 x 128 a slot
    qwen = GPT2Config(vocab_size=512, n_positions=40960, n_embd=1024, n_layer=28, n_head=8)
    blocks = choose_num_blocks(qwen, 16, torch.bfloat16, cpu, max_num_seqs=256, memory_bytes=126 * 2**30)
    assert (blocks + 1) * 16 * 2 * 8 * 128 < 2**31 <= (blocks + 2) * 16 * 2 * 8 * 128


