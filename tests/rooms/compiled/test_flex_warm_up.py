"""flex as it serves on a GPU compiles every kind of step before the first request (compiled/warm_up.py), and
nothing after: checked on the CPU through Dynamo's eager backend (conftest.py's flex_traced_as_on_a_gpu),
whose guards are the GPU's. A recompile after the warm-up would switch flex off mid-run (a path failure,
compiled/forward.py), so the test asserts neither a compile nor a fallback over a varied run."""

import random

from engine_checks import assert_all_free

from minfer import LLM, SamplingParams
from minfer.compiled import cuda_graphs


def test_no_recompile_after_warm_up_over_a_varied_run(tiny_checkpoint, flex_traced_as_on_a_gpu, monkeypatch):
    """Batch 1, batches of many, prefix hits, chunked prefill over several query tiles and preemption, with the
    decode steps through the (unrecorded) CUDA graphs, as on a GPU."""
    compiles = flex_traced_as_on_a_gpu
    monkeypatch.setattr(
        cuda_graphs, "wants_decode_graphs", lambda device, eager, backend: not eager and backend.captures_in_graphs
    )
    eager = LLM(tiny_checkpoint, num_kv_blocks=64, attention_backend="eager")
    llm = LLM(tiny_checkpoint, num_kv_blocks=40, max_num_seqs=9, max_num_batched_tokens=160, attention_backend="auto")
    compiled = llm.scheduler.runner.compiled
    assert compiled.sealed and compiled.graphs is not None and not compiled.fallbacks
    at_start = len(compiles)
    rng = random.Random(3)
    shared = [rng.randrange(512) for _ in range(40)]
    prompts = [[rng.randrange(512) for _ in range(rng.randrange(2, 200))] for _ in range(9)]
    prompts += [shared + [rng.randrange(512) for _ in range(rng.randrange(1, 30))] for _ in range(4)]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    lone = [o.token_ids for o in llm.generate(prompts[:1], greedy, use_tqdm=False)]
    outs = [o.token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["recompute_cache_hit_tokens"] > 0
    assert len(compiles) == at_start and stats["num_path_fallbacks"] == 0, compiled.fallbacks
    assert lone + outs == [o.token_ids for o in eager.generate(prompts[:1] + prompts, greedy, use_tqdm=False)]
    assert_all_free(llm)
