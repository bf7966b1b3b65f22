"""Logprobs and prompt logprobs from the engine: exactly transformers' fp32 log_softmax at the same
positions, the same top-k sets, greedy tokens the argmax, under batching, chunked prefill, prefix-cache
hits and preemption; prompt positions scored a bounded number of rows at a time."""

import pytest
import torch

from minfer import LLM, SamplingParams
from minfer.scoring.logprobs import MAX_LOGPROBS, max_logprob_rows

transformers = pytest.importorskip("transformers")

TOL = 1e-4
K = 5


def hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """(T, V) fp32 log_softmax of transformers' logits over the whole sequence."""
    with torch.inference_mode():
        return hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)


def assert_entry_matches(entry, row: torch.Tensor, token: int, k: int):
    assert entry.token_id == token
    assert abs(entry.logprob - row[token].item()) < TOL, (entry.logprob, row[token].item())
    likelier = (row > entry.logprob + TOL).sum().item(), (row > entry.logprob - TOL).sum().item()
    assert likelier[0] + 1 <= entry.rank <= likelier[1] + 1  # a near-tie may rank either way
    values, ids = row.topk(k)
    assert len(entry.top) == k
    assert {t for t, _ in entry.top} == set(ids.tolist())
    for (t, lp), v in zip(entry.top, values.tolist()):
        assert abs(lp - row[t].item()) < TOL and abs(lp - v) < TOL
    assert [lp for _, lp in entry.top] == sorted((lp for _, lp in entry.top), reverse=True)


def check_against_hf(hf_model, out, k=K, greedy=True):
    ids = out.prompt_token_ids + out.token_ids
    ref = hf_logprobs(hf_model, ids)  # (T, V)
    P = len(out.prompt_token_ids)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == P
    for i in range(1, P):  # prompt token i is scored by position i - 1
        assert_entry_matches(out.prompt_logprobs[i], ref[i - 1], ids[i], k)
    assert len(out.logprobs) == len(out.token_ids)
    for j, entry in enumerate(out.logprobs):
        assert_entry_matches(entry, ref[P - 1 + j], out.token_ids[j], k)
        if greedy:  # the greedy token is the argmax of the distribution returned
            assert entry.top[0][0] == out.token_ids[j] and entry.top[0][1] == entry.logprob


def prompts(n, vocab, seed=0, shared=40):
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab - 1, (shared,), generator=g).tolist()
    out = []
    for i in range(n):
        length = int(torch.randint(2, 150, (1,), generator=g))
        ids = torch.randint(0, vocab - 1, (length,), generator=g).tolist()
        out.append(prefix + ids if i % 2 == 0 else ids)
    return out


SCORED = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=K, prompt_logprobs=K)


@pytest.fixture(scope="module")
def gpt2_hf(tiny_checkpoint):
    return transformers.GPT2LMHeadModel.from_pretrained(tiny_checkpoint, torch_dtype=torch.float32).eval()


def test_busy_engine_matches_transformers(tiny_checkpoint, gpt2_hf):
    """Chunked prefill (64 tokens a step), preemption (16 blocks for 10 requests), and prefix-cache hits from
    the first round serving the second, whose prompt logprobs must still be complete. A preempted request
    re-admitted may reuse the blocks of the positions it has already scored, and no others."""
    batch = prompts(10, 512)
    llm = LLM(tiny_checkpoint, num_kv_blocks=16, max_num_seqs=10, max_num_batched_tokens=64)
    scored = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=K, prompt_logprobs=K)
    plain = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for round in range(2):
        outs = llm.generate(batch, [scored, plain] * 5, use_tqdm=False)
        for out in outs[::2]:
            check_against_hf(gpt2_hf, out)
        for out in outs[1::2]:  # no cost for the rest: nothing computed, nothing returned
            assert out.logprobs is None and out.prompt_logprobs is None
    stats = llm.stats()
    assert stats["num_preemptions"] > 0 and stats["recompute_cache_hit_tokens"] > 0
    assert sum(o.num_recompute_cached_tokens for o in outs[1::2]) > 0, "the plain requests still use the prefix cache"
    assert sum(o.num_recompute_cached_tokens for o in outs[::2]) > 0, "a preempted scored request reused what it scored"
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    llm.scheduler.check_invariants()


def test_a_request_whose_prompt_is_scored_reuses_its_generated_blocks_after_preemption(tiny_checkpoint):
    """Once the whole prompt is scored, a prefix hit skips nothing still to score: a preempted request's recompute
    finds its generated tokens' blocks too, as a request without prompt logprobs does (it stopped at the prompt's)."""
    first, second = list(range(100, 140)), list(range(200, 240))  # the second, newest, is preempted past its prompt
    reused = []
    for prompt_logprobs in (None, 0):
        llm = LLM(tiny_checkpoint, block_size=4, num_kv_blocks=30)
        params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
                  SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, prompt_logprobs=prompt_logprobs)]
        _, out = llm.generate([first, second], params, use_tqdm=False)
        assert out.num_preemptions == 1
        reused.append((out.num_recompute_cached_tokens, out.token_ids))
        assert llm.stats()["num_kv_blocks_free"] == llm.stats()["num_kv_blocks_total"]
    assert len(out.prompt_logprobs) == len(second)
    assert reused[0][0] > len(second)  # its own generated tokens' blocks, not just its prompt's
    assert reused[1] == reused[0]


@pytest.mark.parametrize("preset", ["qwen3-tiny", "llama-tiny", "llama2-tiny"])
def test_llama_family_matches_transformers(make_checkpoint, preset):
    path = make_checkpoint(preset)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, num_kv_blocks=32, max_num_batched_tokens=48)
    vocab = hf.config.vocab_size
    for out in llm.generate(prompts(4, vocab, seed=1), SCORED, use_tqdm=False):
        check_against_hf(hf, out)


def test_sampled_tokens_get_raw_logprobs(tiny_checkpoint, gpt2_hf):
    """Temperature and top-k change what is drawn, not the logprobs reported: the model's own."""
    params = SamplingParams(max_tokens=8, temperature=1.7, top_k=3, seed=4, ignore_eos=True, logprobs=0)
    out = LLM(tiny_checkpoint).generate([[5, 6, 7]], params, use_tqdm=False)[0]
    ref = hf_logprobs(gpt2_hf, out.prompt_token_ids + out.token_ids)
    for j, entry in enumerate(out.logprobs):
        assert entry.top == () and entry.token_id == out.token_ids[j]
        assert abs(entry.logprob - ref[2 + j, entry.token_id].item()) < TOL
    assert out.prompt_logprobs is None


def test_mixed_k_in_one_batch(tiny_checkpoint, gpt2_hf):
    """Each request gets its own k though a step computes the largest."""
    ks = [0, 1, MAX_LOGPROBS]
    params = [SamplingParams(max_tokens=3, temperature=0, logprobs=k, prompt_logprobs=k) for k in ks]
    outs = LLM(tiny_checkpoint).generate([[1, 2, 3, 4]] * 3, params, use_tqdm=False)
    for k, out in zip(ks, outs):
        check_against_hf(gpt2_hf, out, k=k, greedy=k > 0)


def test_prompt_rows_per_step_are_capped(tiny_checkpoint, gpt2_hf):
    """A long prompt is scored a capped number of positions per step, never all at once."""
    llm = LLM(tiny_checkpoint, max_num_batched_tokens=256)
    assert llm.scheduler.features.scoring.max_rows == max_logprob_rows(512) == 2**24 // 512
    llm.scheduler.features.scoring.max_rows = 20
    rows_seen = []
    model = llm.scheduler.runner.model
    original = model.forward
    model.forward = lambda ids, paged=None: rows_seen.append(len(paged.sample_rows)) or original(ids, paged)
    prompt = torch.randint(0, 511, (200,), generator=torch.Generator().manual_seed(2)).tolist()
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=1, logprobs=1)
    out, _plain = llm.generate([prompt, prompt[:150]], [params, SamplingParams(max_tokens=2)], use_tqdm=False)
    assert max(rows_seen) <= 20 + 2  # the scored rows plus at most one sampled row per request
    assert len(rows_seen) >= 10  # 199 positions, 20 a step
    check_against_hf(gpt2_hf, out, k=1)


def test_logprob_counts_are_checked():
    for field in ("logprobs", "prompt_logprobs"):
        for bad in (-1, 21, 1.5, True, "3"):
            with pytest.raises(ValueError, match=field):
                SamplingParams(**{field: bad})


def test_an_idle_engine_keeps_no_logprobs_of_requests_handed_out_or_discarded(tiny_checkpoint):
    """The last step's chunks (the live view's, StepStats') hold their sequences while the engine idles; the
    sequences hold no logprobs once their outputs took them or their request was discarded (prompt_logprobs=20
    over a 1000-token prompt were 2.7 MB, kept until the next request)."""
    llm = LLM(tiny_checkpoint, num_kv_blocks=64)
    sched, params = llm.scheduler, SamplingParams(max_tokens=3, prompt_logprobs=MAX_LOGPROBS, logprobs=K)
    (out,) = llm.generate([list(range(1, 201))], params, use_tqdm=False)
    assert len(out.prompt_logprobs) == 200 and len(out.logprobs) == 3  # the output has them
    assert sched.last_chunks and sched.last_step.num_seqs == 1  # the last step, still there to read
    assert [(c.seq.prompt_logprobs, c.seq.logprobs) for c in sched.last_chunks] == [(None, None)]
    request_id = sched.add_request(prompt_token_ids=list(range(1, 101)), sampling_params=params)
    sched.step()  # the prompt in one chunk: its logprobs are on the sequence
    assert len(sched.last_chunks[0].seq.prompt_logprobs) == 100
    sched.discard_request(request_id)
    assert [(c.seq.prompt_logprobs, c.seq.logprobs) for c in sched.last_chunks] == [(None, None)]
