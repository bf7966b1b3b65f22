"""The policy (engine/continuous_batcher.py) at work: 32 prompts scheduled together, in 64-token chunks,
preempted when a 45-block cache runs out, reusing a shared prefix, each give the greedy tokens they give alone
and that transformers gives; and every KV block comes back."""

import pytest
import torch
from engine_checks import GREEDY, assert_all_free, hf_greedy, random_prompts

from minfer import LLM

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    return transformers.GPT2LMHeadModel.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32).eval()


def test_32_prompts_together_equal_alone_and_transformers(tiny_checkpoint, hf_model):
    prompts = random_prompts(32, 512)
    # Small budgets force every mechanism: chunked prefill (64 tokens a step, prompts up
    # to 200), preemption (45 blocks of 16 for 32 sequences of up to 232 tokens), prefix reuse.
    busy = LLM(tiny_checkpoint, num_kv_blocks=45, max_num_seqs=32, max_num_batched_tokens=64)
    together = busy.generate(prompts, GREEDY, use_tqdm=False)
    stats = busy.stats()
    assert stats["num_preemptions"] > 0, "the cache was meant to be too small to avoid preemption"
    assert stats["prefix_cache_hit_tokens"] > 0
    assert_all_free(busy)

    alone_llm = LLM(tiny_checkpoint, num_kv_blocks=64, enable_prefix_caching=False)
    for prompt, out in zip(prompts, together):
        alone = alone_llm.generate([prompt], GREEDY, use_tqdm=False)[0]
        expected = hf_greedy(hf_model, prompt)
        assert out.token_ids == alone.token_ids == expected
        assert out.prompt_token_ids == prompt
        assert out.finish_reason == ("stop" if expected[-1] == 511 and len(expected) < 32 else "length")
    assert sum(len(set(o.token_ids)) > 4 for o in together) > 16  # real continuations, not one token
    assert_all_free(alone_llm)
