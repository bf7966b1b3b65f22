"""n > 1 completions of one prompt: the prompt is prefilled once, its full blocks shared by reference
count, its last partial block copied on write; seeded choices replay; nothing leaks."""

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.errors import InvalidParameter
from minfer.server.metrics import Metrics
from minfer.server.prometheus import render


def assert_all_free(llm):
    stats = llm.stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"] and stats["num_kv_blocks_shared"] == 0
    assert stats["num_running"] == stats["num_waiting"] == 0 and not llm.scheduler.requests
    llm.scheduler.check_invariants()


def prompt_of(length, seed=0):
    return torch.randint(0, 511, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def long_checkpoint(make_checkpoint):
    return make_checkpoint(n_positions=1024)


@pytest.fixture(scope="module")
def llm(long_checkpoint):
    return LLM(long_checkpoint, num_kv_blocks=400)


def step_until_forked(sched, n):
    while len(sched.running) < n:
        sched.step()
        sched.check_invariants()


def test_eight_samples_of_a_512_token_prompt_hold_its_32_blocks_once(llm):
    sched = llm.scheduler
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1, n=8, ignore_eos=True)
    rid = sched.add_request(prompt_token_ids=prompt_of(512), sampling_params=params)
    step_until_forked(sched, 8)
    tables = [seq.block_table for seq in sched.running]
    assert all(t == tables[0] for t in tables) and len(tables[0]) == 32  # 512 tokens / 16 per block
    stats = sched.stats()
    assert stats["num_kv_blocks_total"] - stats["num_kv_blocks_free"] == 32, "the prompt is held once"
    assert stats["num_kv_blocks_shared"] == 32
    assert "\nminfer_kv_blocks_shared 32\n" in render(Metrics(), stats)  # what /metrics serves
    sched.step()  # each choice's first decode opens a block of its own; the prompt stays shared
    used = stats["num_kv_blocks_total"] - sched.stats()["num_kv_blocks_free"]
    assert used == 32 + 8 and sched.stats()["num_kv_blocks_shared"] == 32
    assert len({seq.block_table[32] for seq in sched.running}) == 8
    while not sched.is_finished(rid):
        sched.step()
    outs = sched.pop_responses(rid)
    assert [o.index for o in outs] == list(range(8)) and all(len(o.token_ids) == 16 for o in outs)
    assert len({tuple(o.token_ids) for o in outs}) == 8
    assert_all_free(llm)


def test_a_cache_too_small_for_eight_copies_serves_n8_without_preempting(long_checkpoint, llm):
    prompt = prompt_of(512, seed=1)
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=7, n=8, ignore_eos=True)
    # Eight copies of 528 tokens would need 8 x 33 = 264 blocks; shared, 32 + 8 fit in 48.
    small = LLM(long_checkpoint, num_kv_blocks=48)
    outs = small.generate([prompt], params, use_tqdm=False)
    assert small.stats()["num_preemptions"] == 0 and all(o.num_preemptions == 0 for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate([prompt], params, use_tqdm=False)]
    assert_all_free(small)


def test_last_partial_block_is_copied_for_each_fork(llm):
    sched = llm.scheduler
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    rid = sched.add_request(prompt_token_ids=prompt_of(21, seed=2), sampling_params=params)  # 16 + 5 tokens
    forks = sched.features.forks
    copies_before = forks.num_copies
    step_until_forked(sched, 3)
    first = sched.requests[rid].seq
    full, partial = first.block_table
    others = [seq for seq in sched.running if seq is not first]
    assert all(seq.block_table[0] == full for seq in sched.running)  # the full prompt block: shared, not copied
    assert forks.num_copies - copies_before == 2, "two of three copy; the first writes in place"
    copies = [seq.block_table[1] for seq in others]
    assert len(set(copies + [partial])) == 3  # each fork its own copy of the partial block
    for copy in copies:  # holding the prompt's keys and values, as the original does
        torch.testing.assert_close(sched.kv_cache.kv[:, copy * 16 : copy * 16 + 5], sched.kv_cache.kv[:, partial * 16 : partial * 16 + 5], rtol=0, atol=0)
    sched.step()
    assert [seq.block_table[1] for seq in sched.running] == [partial, *copies]  # each writes its own
    while not sched.is_finished(rid):
        sched.step()
    forked = sched.pop_responses(rid)
    # Each choice is exactly what a request with its seed (seed + index) draws alone: the copies hold the
    # prompt's keys and values.
    for out in forked:
        alone = SamplingParams(max_tokens=6, temperature=1.0, seed=11 + out.index, ignore_eos=True)
        assert out.token_ids == llm.generate([prompt_of(21, seed=2)], alone, use_tqdm=False)[0].token_ids
    assert_all_free(llm)


def test_a_fork_without_a_free_block_computes_the_partial_block_again(long_checkpoint, llm):
    """No block free for a copy: the fork shares the full blocks only and computes the partial one's tokens
    again. The choices draw what they draw with room to spare."""
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=21, n=2, ignore_eos=True)
    prompt = prompt_of(21, seed=5)  # 16 + 5 tokens: a full block and a partial one
    tight = LLM(long_checkpoint, num_kv_blocks=2, max_model_len=32)
    copies = tight.scheduler.features.forks.num_copies
    outs = tight.generate([prompt], params, use_tqdm=False)
    assert tight.scheduler.features.forks.num_copies == copies  # nothing was free to copy into
    assert [o.token_ids for o in outs] == [o.token_ids for o in llm.generate([prompt], params, use_tqdm=False)]
    assert_all_free(tight)


def test_a_preempted_fork_of_a_scored_prompt_reuses_the_cached_blocks(tiny_checkpoint):
    """A fork holds its prompt's logprobs from the start (scoring/): its prompt is scored, so a recompute after
    a preemption reuses the cached blocks, as a fork without prompt logprobs does (it recomputed them all)."""
    reused = []
    for prompt_logprobs in (None, 0):
        llm = LLM(tiny_checkpoint, block_size=4, num_kv_blocks=24)  # 40 + 40 tokens each: the second is preempted
        params = SamplingParams(max_tokens=40, temperature=0, n=2, ignore_eos=True, prompt_logprobs=prompt_logprobs)
        first, fork = llm.generate([list(range(100, 140))], params, use_tqdm=False)
        assert (first.num_preemptions, fork.num_preemptions) == (0, 1)
        reused.append((fork.num_recompute_cached_tokens, fork.token_ids))
        assert_all_free(llm)
    assert len(fork.prompt_logprobs) == 40 and reused[0][0] > 0
    assert reused[1] == reused[0]


def test_seeded_choices_replay_whatever_runs_beside_them(long_checkpoint, llm):
    prompt = prompt_of(40, seed=3)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=5, n=4, ignore_eos=True, frequency_penalty=0.5)
    first = [o.token_ids for o in llm.generate([prompt], params, use_tqdm=False)]
    assert first == [o.token_ids for o in llm.generate([prompt], params, use_tqdm=False)]
    others = [prompt_of(30 + i, seed=10 + i) for i in range(5)]
    crowd = llm.generate(others + [prompt], [SamplingParams(max_tokens=20, temperature=1.2)] * 5 + [params],
                         use_tqdm=False)
    assert [o.token_ids for o in crowd[-4:]] == first
    # A tight cache preempts and recomputes choices; the draws do not change.
    tight = LLM(long_checkpoint, num_kv_blocks=12, max_num_batched_tokens=32)
    squeezed = tight.generate(others + [prompt], [SamplingParams(max_tokens=20, temperature=1.2)] * 5 + [params],
                              use_tqdm=False)
    assert tight.stats()["num_preemptions"] > 0
    assert [o.token_ids for o in squeezed[-4:]] == first
    assert_all_free(tight)


def test_greedy_choices_agree_and_stops_end_each_choice_on_its_own(llm):
    prompt = prompt_of(30, seed=4)
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    one = llm.generate([prompt], greedy, use_tqdm=False)[0].token_ids
    outs = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, n=3), use_tqdm=False)
    assert [o.token_ids for o in outs] == [one] * 3
    sampled = SamplingParams(max_tokens=30, temperature=1.5, seed=2, n=6, ignore_eos=True)
    runs = llm.generate([prompt], sampled, use_tqdm=False)
    stop_id = runs[0].token_ids[3]  # a token choice 0 draws fourth: a stop token for all six
    stopped = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=1.5, seed=2, n=6, ignore_eos=True,
                                                    stop_token_ids=[stop_id]), use_tqdm=False)
    for run, out in zip(runs, stopped):
        end = run.token_ids.index(stop_id) + 1 if stop_id in run.token_ids else 30
        assert out.token_ids == run.token_ids[:end]
        assert out.finish_reason == ("stop" if stop_id in run.token_ids else "length")
    assert_all_free(llm)


def test_discarding_frees_every_choice_at_any_point(long_checkpoint):
    llm = LLM(long_checkpoint, num_kv_blocks=80, max_num_batched_tokens=64)  # a 200-token prompt takes 4 steps
    sched = llm.scheduler
    params = SamplingParams(max_tokens=40, temperature=1.0, n=5, ignore_eos=True)
    for steps in (0, 2, 5, 9):  # queued, prefilling (forks not started), just forked, decoding
        rid = sched.add_request(prompt_token_ids=prompt_of(200, seed=steps), sampling_params=params)
        keep = sched.add_request(prompt_token_ids=prompt_of(50, seed=99), sampling_params=params)
        for _ in range(steps):
            sched.step()
            sched.check_invariants()
        assert sched.discard_request(rid)
        sched.check_invariants()
        while not sched.is_finished(keep):
            sched.step()
        assert len(sched.pop_responses(keep)) == 5
        assert_all_free(llm)


def test_n_takes_its_slots_and_more_than_the_batch_is_refused(long_checkpoint):
    llm = LLM(long_checkpoint, num_kv_blocks=200, max_num_seqs=4)
    with pytest.raises(InvalidParameter, match="max_num_seqs") as e:
        llm.scheduler.add_request(prompt_token_ids=[1, 2], sampling_params=SamplingParams(n=5))
    assert e.value.param == "n"
    sched = llm.scheduler
    params = SamplingParams(max_tokens=8, temperature=1.0, n=3, ignore_eos=True)
    ids = [sched.add_request(prompt_token_ids=prompt_of(20, seed=i), sampling_params=params) for i in range(3)]
    while sched.has_unfinished():
        sched.step()
        assert sum(s.seats for s in sched.running) <= 4  # a prompt holds its forks' seats until they start
    assert all(len(sched.pop_responses(i)) == 3 for i in ids)
    assert_all_free(llm)


def test_generate_returns_each_prompts_choices_flat_in_prompt_order(llm):
    """LLM.generate's documented shape (docs/sampling.md): one RequestOutput per choice, a prompt's n together,
    in `index` order, prompts in order (vLLM's generate nests them instead: RequestOutput.outputs)."""
    prompts = [prompt_of(5, seed=3), prompt_of(9, seed=4)]
    params = [SamplingParams(max_tokens=3, temperature=1.0, seed=1, n=n) for n in (2, 3)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [(o.prompt_token_ids, o.index) for o in outs] == [(prompts[0], 0), (prompts[0], 1),
                                                             (prompts[1], 0), (prompts[1], 1), (prompts[1], 2)]
    assert_all_free(llm)
