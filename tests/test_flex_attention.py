"""The FlexAttention backend (attention/flex.py), GPUs' default, checked here on the CPU: flex_attention
compiles there too (C++ loops rather than Triton), and the block mask it reads is the same."""

import pytest
import torch
from test_engine import assert_all_free, random_prompts
from torch.nn.attention.flex_attention import flex_attention

from minfer import LLM, SamplingParams
from minfer.attention import flex, selector
from minfer.attention.flex import FlexBackend


@pytest.mark.parametrize("dtype, heads, kv_heads", [(torch.bfloat16, 8, 2)])  # as on a GPU: bf16, grouped-query
def test_flex_computes_what_the_plain_backend_does(dtype, heads, kv_heads):
    """warm_up's own check: decode batches, a chunk over earlier context and a step of all three kinds,
    on a cache whose unwritten slots hold large garbage, against TorchBackend."""
    backend = FlexBackend("cpu", dtype)
    assert backend.warm_up(heads, kv_heads, 16, block_size=16) is None


def test_flex_refuses_blocks_too_small_for_it():
    assert "at least 16 tokens, not 8" in FlexBackend("cpu", torch.float32).warm_up(4, 4, 16, block_size=8)


def test_engine_on_flex_equals_the_plain_backend(tiny_checkpoint, monkeypatch):
    """Chunked prefill, prefix hits and preemption with every step's attention through FlexAttention:
    the same greedy tokens as the eager engine. Unfused here (a CPU compiles each new shape; the tests
    above check the compiled kernel), which reads every block of the cache: the mask alone must keep
    each sequence to its own."""
    monkeypatch.setitem(flex._flex_compiled, "static", flex_attention)
    prompts = random_prompts(12, 512, seed=6, max_len=150)
    greedy = SamplingParams(max_tokens=24, temperature=0)
    eager = LLM(tiny_checkpoint, num_kv_blocks=64, attention_backend="eager")
    expected = [o.token_ids for o in eager.generate(prompts, greedy, use_tqdm=False)]
    monkeypatch.setattr(selector, "backend_name", lambda *args, **kwargs: "flex")
    llm = LLM(tiny_checkpoint, num_kv_blocks=40, max_num_seqs=12, max_num_batched_tokens=64)
    assert isinstance(llm.scheduler.runner.attention_backend, FlexBackend)
    assert llm.scheduler.kv_cache.layout == "slots" and not llm.scheduler.kv_cache.kv.isnan().any()  # zeroed
    outs = llm.generate(prompts, greedy, use_tqdm=False)
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert [o.token_ids for o in outs] == expected
    assert_all_free(llm)
