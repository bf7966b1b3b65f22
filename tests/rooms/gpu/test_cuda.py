"""What only a GPU can show: one host sync per engine step, and GPU memory that stays put.

These run where the tests' device is a GPU (`MINFER_DEVICE=cuda`, tests/conftest.py;
scripts/gpu_check.sh runs them with the rest of the GPU-ready tests). On a CPU there is no
sync to count (a CPU tensor's `.tolist()` only reads memory), so they are skipped there.
"""

import warnings

import pytest
import torch
from conftest import TEST_DEVICE
from engine_checks import assert_all_free, random_prompts

from minfer import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.skipif(
    torch.device(TEST_DEVICE).type != "cuda", reason="needs a CUDA device: run with MINFER_DEVICE=cuda"
)


def syncs_per_step(llm: LLM) -> list[int]:
    """Step the engine until it is idle, counting each step's synchronizing CUDA calls: what
    torch.cuda.set_sync_debug_mode("warn") warns about (a device-to-host copy, .item(), a
    boolean mask's nonzero, ...)."""
    counts = []
    torch.cuda.set_sync_debug_mode("warn")
    try:
        while llm.scheduler.has_unfinished():
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                llm.scheduler.step()
            counts.append(sum("synchronizing" in str(w.message) for w in caught))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return counts


def test_every_step_syncs_with_the_host_exactly_once(tiny_checkpoint):
    """Prefill chunks, decodes, greedy and seeded sampling, top-k/top-p, penalties, logprobs and a JSON schema's
    mask in one batch: the step's single .tolist() is its only sync."""
    llm = LLM(tiny_checkpoint, num_kv_blocks=64, max_num_batched_tokens=64)
    prompts = random_prompts(8, 512, seed=2, max_len=90)
    schema = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 20}
    params = [
        SamplingParams(max_tokens=12, temperature=0),
        SamplingParams(max_tokens=12, temperature=0.8, seed=3),
        SamplingParams(max_tokens=12, top_k=5, top_p=0.9, seed=4),
        SamplingParams(max_tokens=12, temperature=0.7, presence_penalty=0.5, repetition_penalty=1.1),
        SamplingParams(max_tokens=12, temperature=0, logprobs=3, prompt_logprobs=2),
        SamplingParams(max_tokens=12, temperature=1.0, min_p=0.1),
        SamplingParams(max_tokens=12, n=2, seed=7, logit_bias={5: 2.0}, min_tokens=4),
        SamplingParams(max_tokens=12, temperature=0.9, seed=8, structured_outputs=StructuredOutputsParams(json=schema)),
    ]
    ids = [llm.scheduler.add_request(prompt_token_ids=prompt, sampling_params=p) for prompt, p in zip(prompts, params)]
    counts = syncs_per_step(llm)
    # A step of prompt chunks that completes no prompt draws nothing, and its empty .tolist() may not sync.
    assert max(counts) == 1 and counts.count(1) >= 12, counts
    outputs = [out for i in ids for out in llm.scheduler.pop_responses(i)]
    assert len(outputs) == 9 and all(len(out.token_ids) == 12 for out in outputs)  # n=2 gave two
    assert_all_free(llm)


def test_gpu_memory_does_not_grow_over_a_run(tiny_checkpoint):
    """The KV cache takes its share when the engine starts; after a first run (whatever compiles lazily),
    a second run of the same work leaves GPU memory where it was and peaks no higher."""
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    llm = LLM(tiny_checkpoint, gpu_memory_utilization=0.02)
    cache = llm.scheduler.kv_cache
    assert torch.cuda.memory_allocated() - before >= cache.kv.numel() * cache.kv.element_size()
    prompts = random_prompts(24, 512, seed=5, max_len=200)
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=1, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    settled = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    llm.generate(prompts, params, use_tqdm=False)
    assert torch.cuda.memory_allocated() == settled
    assert torch.cuda.max_memory_allocated() - settled < 64 * 2**20  # a step's temporaries, not a second cache
    assert_all_free(llm)


def test_cuda_graphs_replay_what_eager_steps_compute(tiny_checkpoint):
    """Decode steps replayed from CUDA graphs (the default on a GPU: FlexAttention, whatever
    $MINFER_ATTENTION_BACKEND gives the other tests) against --enforce-eager: the same greedy tokens, in
    fp32, over batches that pad up to the captured sizes."""
    prompts = random_prompts(11, 512, seed=9, max_len=120)
    params = [SamplingParams(max_tokens=12 + i, temperature=0) for i in range(len(prompts))]
    eager = LLM(tiny_checkpoint, num_kv_blocks=64, enforce_eager=True)
    assert eager.scheduler.runner.compiled is None
    expected = [o.token_ids for o in eager.generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_checkpoint, num_kv_blocks=64, max_num_seqs=11, attention_backend="auto")
    graphs = llm.scheduler.runner.compiled.graphs
    assert graphs is not None and all(graph is not None for graph in graphs.graphs.values())
    assert [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == expected
    assert graphs.num_steps > 20
    llm.close()
    assert not graphs.graphs
