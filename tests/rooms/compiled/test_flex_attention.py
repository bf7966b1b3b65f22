"""The FlexAttention backend (compiled/flex.py), GPUs' default, checked here on the CPU: its results
through flex_attention's unfused path (the mask_mod alone), and the block lists a fused kernel reads.
The fused kernels themselves (Triton) run on a GPU: scripts/gpu_check.sh runs this file there."""

import pytest
import torch
from engine_checks import assert_all_free, random_prompts

from minfer import LLM, SamplingParams
from minfer.attention.kv_cache import KVCache
from minfer.compiled.flex import FlexBackend
from minfer.attention.backend import StepLayout


@pytest.mark.parametrize("dtype, heads, kv_heads", [(torch.float32, 4, 4), (torch.bfloat16, 8, 2)])
def test_flex_computes_what_the_plain_backend_does(flex_as_on_a_gpu, dtype, heads, kv_heads):
    """warm_up's own check: decode batches, a chunk over earlier context and a step of all three kinds,
    on a cache whose unwritten slots hold large garbage, against TorchBackend."""
    backend = FlexBackend("cpu", dtype)
    assert backend.warm_up(heads, kv_heads, 16, block_size=16) is None


def test_block_masks_list_each_sequences_own_blocks():
    """What the fused kernels read (the unfused path above ignores it): each tile of queries visits the
    blocks of its own sequence's table, as far as its context reaches, and no others."""
    B, null = 16, 20
    tables = [[3, 7, 1], [5], [9, 2, 11, 4]]
    lens, news = [40, 16, 60], [1, 1, 9]  # two decodes, then a chunk of 9 after 51 cached tokens
    layout = StepLayout(torch.zeros(11, dtype=torch.long), [0, 1, 2], news, lens, tables, B, null)
    meta = FlexBackend("cpu", torch.float32).build_metadata(layout)
    dense = meta.decode_mask.to_dense()  # (S, 1, query tiles, key blocks)
    assert dense.shape == (2, 1, 1, null + 1)
    assert [row.nonzero().flatten().tolist() for row in dense[:, 0, 0]] == [[1, 3, 7], [5]]
    ((start, end, chunk_mask),) = meta.chunks
    assert (start, end) == (2, 11) and chunk_mask.to_dense()[0, 0, 0].nonzero().flatten().tolist() == [2, 4, 9, 11]
    assert meta.decode_rows.tolist() == [0, 1] and not meta.all_decode


def test_flex_refuses_blocks_too_small_for_it():
    assert "at least 16 tokens, not 8" in FlexBackend("cpu", torch.float32).warm_up(4, 4, 16, block_size=8)


def test_engine_on_flex_equals_the_plain_backend(tiny_checkpoint, flex_as_on_a_gpu):
    """Chunked prefill, prefix hits and preemption with every step's attention through FlexAttention:
    the same greedy tokens as the eager engine. Unfused (conftest.py's flex_as_on_a_gpu), which reads every
    block of the cache: the mask alone must keep each sequence to its own."""
    prompts = random_prompts(12, 512, seed=6, max_len=150)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    eager = LLM(tiny_checkpoint, num_kv_blocks=64, attention_backend="eager")
    expected = [o.token_ids for o in eager.generate(prompts, greedy, use_tqdm=False)]
    llm = LLM(tiny_checkpoint, num_kv_blocks=40, max_num_seqs=12, max_num_batched_tokens=64, attention_backend="auto")
    assert isinstance(llm.scheduler.runner.attention, FlexBackend)
    assert type(llm.scheduler.kv_cache) is KVCache and not llm.scheduler.kv_cache.kv.isnan().any()  # plain, zeroed
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["recompute_cache_hit_tokens"] > 0
    assert [o.token_ids for o in outs] == expected
    assert_all_free(llm)
