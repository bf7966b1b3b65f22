"""Decode steps through static buffers and padded batches (compiled/cuda_graphs.py), as CUDA graphs replay
them. On a CPU nothing is recorded (capture=False): the padded steps run as they are, which checks
everything but the recording. tests/rooms/gpu/test_cuda.py and scripts/gpu_check.sh run them on a GPU."""

import pytest
from engine_checks import assert_all_free, random_prompts

from minfer import LLM, SamplingParams
from minfer.assembly.selector import backend_name
from minfer.compiled import cuda_graphs
from minfer.compiled.cuda_graphs import graph_batch_sizes


def test_batch_sizes_cover_every_batch_up_to_the_largest():
    assert graph_batch_sizes(256) == [1, 2, 4, 8, *range(16, 257, 16)]
    assert graph_batch_sizes(12) == [1, 2, 4, 8, 12]
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.fixture
def graphed(flex_as_on_a_gpu, monkeypatch, tiny_checkpoint):
    """An engine on FlexAttention (conftest.py's flex_as_on_a_gpu) with decode graphs, as on a GPU: where the
    backend can build its metadata in a graph and eager was not asked for."""
    monkeypatch.setattr(
        cuda_graphs,
        "wants_decode_graphs",
        lambda device, eager, backend: not eager and backend.captures_in_graphs,
    )
    return lambda **settings: LLM(tiny_checkpoint, attention_backend="auto", **settings)


def test_padded_decode_steps_equal_eager_steps(graphed, tiny_checkpoint):
    """Batches of every size between the captured ones (padded), prefix hits and preemption: the same
    greedy tokens and logprobs as the eager engine, and every decode step served from the buffers."""
    prompts = random_prompts(11, 512, seed=8, max_len=120)
    params = [SamplingParams(max_tokens=16 + i, temperature=0, logprobs=2) for i in range(len(prompts))]
    eager = LLM(tiny_checkpoint, num_kv_blocks=64, attention_backend="eager")
    plain = backend_name(eager.model.device, eager.model.dtype, "eager")  # cpu_tiled on a CPU, torch on a GPU
    assert eager.scheduler.runner.compiled is None and eager.scheduler.runner.attention.name == plain
    expected = eager.generate(prompts, params, use_tqdm=False)
    llm = graphed(num_kv_blocks=40, max_num_seqs=11, max_num_batched_tokens=64)
    graphs = llm.scheduler.runner.compiled.graphs
    assert graphs.sizes == [1, 2, 4, 8, 11] and sorted(graphs.graphs) == graphs.sizes  # all "captured" at start
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.stats()["num_preemptions"] > 0 and llm.stats()["recompute_cache_hit_tokens"] > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    for got, want in zip(outs, expected):
        assert len(got.logprobs) == len(want.logprobs)
        for a, b in zip(got.logprobs, want.logprobs):
            assert (a.token_id, a.rank) == (b.token_id, b.rank) and abs(a.logprob - b.logprob) < 1e-4
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert graphs.num_steps > 20  # the decode steps (finishing at different times: every size)
    assert_all_free(llm)


def test_forks_replay_and_close_releases(graphed):
    """n = 2: the prompt's step samples its last row twice (eager), then the two forks decode side by side
    (replayed). close() frees the graphs; the engine still serves, eager."""
    llm = graphed(num_kv_blocks=40, max_num_seqs=4, max_model_len=64)
    graphs = llm.scheduler.runner.compiled.graphs
    assert graphs.max_blocks == 4  # the static tables: max_model_len / block_size columns
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=6, n=2, seed=1), use_tqdm=False)
    assert len(out) == 2 and out[0].token_ids != out[1].token_ids and graphs.num_steps == 5
    llm.close()
    assert llm.scheduler.runner.compiled.graphs is None and not graphs.graphs
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_tqdm=False)[0].token_ids) == 3
    assert graphs.num_steps == 5


def test_every_graph_writes_one_shared_logits_buffer(graphed):
    """One (max_num_seqs, V) buffer for every batch size's logits, not one per graph (0.67 GB for 256 Qwen3
    rows): each step's logits are a view of it."""
    llm = graphed(num_kv_blocks=40, max_num_seqs=6, max_model_len=64)
    graphs = llm.scheduler.runner.compiled.graphs
    assert graphs.logits.shape == (6, llm.model.config.vocab_size)
    run, served = graphs.run, []

    def spy(*args):
        logits = run(*args)
        served.append((logits.shape[0], logits.untyped_storage().data_ptr()))
        return logits

    graphs.run = spy
    llm.generate([[1, 2, 3], [4, 5], [6]], SamplingParams(max_tokens=4), use_tqdm=False)
    assert {rows for rows, _ in served} == {3} and {ptr for _, ptr in served} == {graphs.logits.data_ptr()}


def test_the_profile_says_which_steps_replayed_graphs(graphed):
    """A replayed graph runs no Python, so it marks no parts: bench.py --profile says how many of its steps
    replayed one, and that their model's time is in the last row."""
    from minfer.bench.profile import REST, format_profile, profile_steps
    from minfer.bench.workload import BenchRequest

    llm = graphed(num_kv_blocks=40, max_num_seqs=4, max_model_len=64)
    requests = [BenchRequest(i, None, list(range(1, 9 + i)), 8 + i, 12, 0.0) for i in range(4)]
    profile = profile_steps(llm.scheduler, requests, num_steps=3)
    phases = profile["phases"]
    assert phases["decode"]["graph_steps"] == 3 and phases["prefill"]["graph_steps"] < 3  # prompts run eagerly
    assert "3 of them replayed CUDA graphs: a replay marks no parts, so its model's whole time" in format_profile(profile)
    assert REST in format_profile(profile)
    assert_all_free(llm)
