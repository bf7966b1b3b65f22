"""What the speculative-decoding tests share: n-gram settings, prompts that repeat themselves, mixed seeded
and unseeded requests, the checks that every block came back and that the prefix cache holds only kept
tokens, and the checks the n-gram and the draft-model tests both run."""

from dataclasses import replace

import torch

from minfer import LLM, SamplingParams


SPEC = {"speculative_method": "ngram", "num_speculative_tokens": 4, "ngram_min": 1, "ngram_max": 3}


def copy_prompts(n, vocab, seed=0, max_len=120):
    """Random prompts, most of them holding a repeated stretch (what n-gram lookup finds), some not."""
    g = torch.Generator().manual_seed(seed)
    prompts = []
    for i in range(n):
        length = int(torch.randint(2, max_len, (1,), generator=g))
        ids = torch.randint(0, vocab - 1, (length,), generator=g).tolist()
        if i % 4 != 3:  # a passage, then its first tokens again: the model may go on copying
            ids = ids + ids[: max(1, length // 3)]
        prompts.append(ids)
    return prompts


def half_seeded(params: SamplingParams, n: int) -> list[SamplingParams]:
    """n copies, every other one with a seed. Greedy ignores the seed, but speculation does not: unseeded
    requests speculate only in small batches (speculator.MAX_BATCH), seeded ones always, so a batch of
    these mixes speculating and plain sequences."""
    return [replace(params, seed=i) if i % 2 == 0 else params for i in range(n)]


def assert_all_free(llm):
    stats = llm.stats()
    assert stats["num_kv_blocks_free"] == stats["num_kv_blocks_total"]
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert all(b.ref_count == 0 for b in llm.scheduler.allocator.blocks)
    llm.scheduler.check_invariants()


def assert_cache_holds_only_kept_tokens(llm, outputs):
    """Every block the prefix cache can hand out holds a run of some request's final tokens."""
    sequences = [tuple(o.prompt_token_ids + o.token_ids) for o in outputs]
    B = llm.scheduler.block_size
    for block_id in llm.scheduler.allocator.cached.values():
        tokens = llm.scheduler.allocator.blocks[block_id].token_ids
        assert any(tokens == s[i : i + B] for s in sequences for i in range(0, len(s) - B + 1, B)), tokens


def run_stepwise(llm, prompts, params):
    """Generate, checking the allocator's invariants after every step."""
    sched = llm.scheduler
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = [sched.add_request(prompt_token_ids=p, sampling_params=s) for p, s in zip(prompts, params)]
    while sched.has_unfinished():
        sched.step()
        sched.check_invariants()
    return [sched.pop_response(i) for i in ids]


def assert_seeded_ignores_batch_neighbours(spec):
    """A seeded request (n = 3) gives the same tokens alone and among 9 unseeded neighbours. In float64:
    in fp32 another batch's rounding moves about one draw in 6,000 (docs/sampling.md)."""
    prompts = copy_prompts(10, 512, seed=5)
    params = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=11, n=3, ignore_eos=True)
    alone = spec.generate([prompts[0]], params, use_tqdm=False)
    others = [SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)] * 9
    together = spec.generate(prompts, [params, *others], use_tqdm=False)
    assert [o.token_ids for o in together[:3]] == [o.token_ids for o in alone]
    assert len({tuple(o.token_ids) for o in alone}) == 3  # three different completions
    assert spec.scheduler.features.speculation.speculator.stats.num_drafts > 0
    assert_all_free(spec)


def exact_distribution(path, prompt, V, positions):
    """p(token at each of `positions` steps after the prompt), exactly, by enumerating every path."""
    from transformers import GPT2LMHeadModel

    hf = GPT2LMHeadModel.from_pretrained(path, torch_dtype=torch.float32).eval()
    paths, probs = [[]], torch.ones(1)
    marginals = []
    with torch.no_grad():
        for _ in range(positions):
            ids = torch.tensor([prompt + p for p in paths])
            next_p = hf(ids).logits[:, -1, :V].softmax(-1).double()  # (P, V): the tokens logit_bias keeps
            joint = probs[:, None] * next_p  # (P, V)
            marginals.append(joint.sum(0))
            paths = [p + [t] for p in paths for t in range(V)]
            probs = joint.flatten()
    return marginals


def assert_speculative_samples_match_exact(path, spec_options):
    """1200 seeded samples of 4 tokens from an 8-token vocabulary, speculating with spec_options, pass a
    chi-square test against the exact marginals at every position. Returns the speculation counts."""
    from scipy.stats import chisquare

    V = 8
    prompt = list(range(V)) * 2 + [0, 1]  # every token occurred: n-gram lookup always proposes
    exact = exact_distribution(path, prompt, V, 4)
    spec = LLM(path, max_num_seqs=128, **spec_options)
    N = 1200
    bias = dict.fromkeys(range(V), 100.0)
    params = [SamplingParams(max_tokens=4, temperature=1.0, seed=i, logit_bias=bias, ignore_eos=True) for i in range(N)]
    outs = spec.generate([prompt] * N, params, use_tqdm=False)
    stats = spec.scheduler.features.speculation.speculator.stats
    assert stats.num_draft_tokens > N and 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    for position in range(4):
        counts = torch.bincount(torch.tensor([o.token_ids[position] for o in outs]), minlength=V).double()
        expected = exact[position] / exact[position].sum() * N
        assert chisquare(counts.numpy(), expected.numpy()).pvalue > 1e-3, (position, counts, expected)
    assert_all_free(spec)
    return stats


def cancel_half_and_finish_the_rest(spec):
    """Six speculating requests: three cancelled mid-way, three run to the end; then every block is free."""
    sched = spec.scheduler
    params = half_seeded(SamplingParams(max_tokens=60, temperature=0, ignore_eos=True), 6)
    ids = [sched.add_request(prompt_token_ids=p, sampling_params=s) for p, s in zip(copy_prompts(6, 512, seed=8), params)]
    for _ in range(12):
        sched.step()
        sched.check_invariants()
    assert sched.features.speculation.speculator.stats.num_drafts > 0
    for i in ids[::2]:
        assert sched.discard_request(i)
    while sched.has_unfinished():
        sched.step()
        sched.check_invariants()
    for i in ids[1::2]:
        sched.pop_response(i)
    assert_all_free(spec)
