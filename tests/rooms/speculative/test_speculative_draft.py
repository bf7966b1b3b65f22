"""Speculative decoding with a draft model (speculative/draft.py): a smaller checkpoint with the
target's vocabulary proposes greedily, its KV cache on the target's blocks. Greedy output stays token for
token plain decoding's, in batches, under chunked prefill, prefix hits and preemption; a draft that is the
target itself is always right, which holds only while its K/V stays in step; sampling stays the target's
distribution; every block comes back."""

import pytest
import torch
from speculation_checks import (
    assert_all_free,
    assert_cache_holds_only_kept_tokens,
    assert_seeded_ignores_batch_neighbours,
    assert_speculative_samples_match_exact,
    cancel_half_and_finish_the_rest,
    copy_prompts,
    half_seeded,
    run_stepwise,
)

from minfer import LLM, EngineConfig, SamplingParams
from minfer.attention.kv_cache import KVCache, slot_of


def draft_settings(path, k=4):
    return {"speculative_method": "draft", "speculative_model": str(path), "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def models(make_checkpoint):
    """Targets and their drafts: the draft has the target's first layer (the same seed), so it agrees
    with the target now and then, and rejections are frequent."""
    return {
        "gpt2": (make_checkpoint(), make_checkpoint("tiny", n_layer=1)),
        "qwen3": (make_checkpoint("qwen3-tiny", seed=2), make_checkpoint("qwen3-tiny", seed=2, num_hidden_layers=1)),
    }


# ---- the options ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"speculative_method": "draft"}, "--speculative-method draft needs --speculative-model"),
        ({"speculative_method": "draft", "speculative_model": "x", "ngram_max": 3}, "--ngram-max applies to .* ngram"),
        ({"speculative_model": "x"}, "--speculative-model applies only with --speculative-method"),
    ],
)
def test_bad_options_are_refused(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_a_draft_that_cannot_serve_is_refused_naming_why(models, make_checkpoint, tmp_path):
    target = models["gpt2"][0]
    with pytest.raises(ValueError, match="--speculative-model .*nothing-here.* is not a directory"):
        LLM(target, **draft_settings(tmp_path / "nothing-here"))
    other_vocab = make_checkpoint("tiny", vocab_size=400)
    with pytest.raises(ValueError, match="vocabulary of 400 tokens, the model 512"):
        LLM(target, **draft_settings(other_vocab))
    short = make_checkpoint("tiny", n_positions=128)
    with pytest.raises(ValueError, match="context of 128 tokens, shorter than the model's 512"):
        LLM(target, **draft_settings(short))
    assert LLM(target, max_model_len=128, **draft_settings(short)).scheduler.features.speculation.draft is not None


def test_the_kv_budget_pays_for_both_caches(models):
    target, draft = models["gpt2"]
    budget = 2**20
    plain = LLM(target, kv_cache_memory=budget, block_size=16)
    spec = LLM(target, kv_cache_memory=budget, block_size=16, **draft_settings(draft))
    per_block = KVCache.bytes_per_block(plain.model.config, 16, torch.float32)
    draft_per_block = KVCache.bytes_per_block(spec.scheduler.features.speculation.draft.model.config, 16, torch.float32)
    assert plain.scheduler.allocator.num_blocks == budget // per_block
    assert spec.scheduler.allocator.num_blocks == budget // (per_block + draft_per_block)
    assert spec.scheduler.features.speculation.draft.kv_cache.kv.shape[1] == spec.scheduler.kv_cache.kv.shape[1]  # the same slots


# ---- greedy: token for token what plain decoding gives -------------------------------------


@pytest.mark.parametrize("family", ["gpt2", "qwen3"])
@pytest.mark.parametrize("self_draft", [False, True], ids=["small-draft", "self-draft"])
def test_greedy_batch_of_32_equals_plain(models, family, self_draft):
    """Chunked prefill (a small token budget), a small cache (preemptions, recomputed with prefix hits),
    half the batch speculating. A draft that is the target proposes the target's own tokens: all are
    accepted, unless a draft K/V is missing or stale (after a rejection, a preemption, a prefix hit)."""
    target, draft = models[family]
    prompts = copy_prompts(32, 512, seed=1)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = LLM(target, block_size=8).generate(prompts, params, use_tqdm=False)
    draft = target if self_draft else draft
    spec = LLM(target, block_size=8, max_num_batched_tokens=64, num_kv_blocks=120, **draft_settings(draft))
    outs = run_stepwise(spec, prompts, half_seeded(params, len(prompts)))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = spec.scheduler.features.speculation.speculator.stats
    assert spec.scheduler.num_preemptions > 0 and spec.scheduler.recompute_cache_hit_tokens > 0
    if self_draft:
        assert stats.num_draft_tokens > 500 and stats.acceptance_rate > 0.99
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert_all_free(spec)
    assert_cache_holds_only_kept_tokens(spec, outs)
    alone = spec.generate(prompts[5], params, use_tqdm=False)[0]
    assert alone.token_ids == plain[5].token_ids


def test_prefix_hits_reuse_both_caches(models):
    """A request whose prompt is an earlier request's prompt and output reads the draft's K/V from the
    cached blocks too: with the target as its own draft, still every proposal is accepted."""
    target, _ = models["gpt2"]
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompts = copy_prompts(4, 512, seed=3)
    spec = LLM(target, block_size=4, **draft_settings(target))
    first = spec.generate(prompts, params, use_tqdm=False)
    again = [o.prompt_token_ids + o.token_ids for o in first]
    got = spec.generate(again, params, use_tqdm=False)
    assert spec.scheduler.prefix_cache_hit_tokens > 100
    want = LLM(target, block_size=4).generate(again, params, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.scheduler.features.speculation.speculator.stats.acceptance_rate > 0.99
    assert_all_free(spec)


def test_forks_copy_both_caches_on_write(models):
    """n = 2 completions share the prompt's last, partly filled block until each writes to it: copy-on-write
    must copy the draft's K/V too, or the self-draft's proposals go wrong."""
    target, _ = models["qwen3"]
    spec = LLM(target, block_size=8, **draft_settings(target))
    params = SamplingParams(max_tokens=30, temperature=0, n=2, ignore_eos=True)
    prompts = copy_prompts(3, 512, seed=6)
    want = LLM(target, block_size=8).generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, half_seeded(params, 3), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    stats = spec.scheduler.features.speculation.speculator.stats
    assert stats.num_draft_tokens > 100 and stats.acceptance_rate > 0.99
    assert_all_free(spec)


@pytest.mark.parametrize(
    "target, draft",
    [("minfer-tiny", "random"), ("minfer-tiny", "minfer-tiny"), ("minfer-tiny-llama", "minfer-tiny-llama-draft")],
    ids=["random-draft", "self-draft", "llama-shipped-draft"],
)
def test_trained_tiny_greedy_equals_plain(make_checkpoint, target, draft):
    from minfer.models.loader import BUILTIN_MODELS

    heldout = (BUILTIN_MODELS[target] / "heldout.txt").read_text(encoding="utf-8")
    prompts = [heldout[:700] + "\n" + heldout[:50], heldout[2000:2300]]
    params = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    plain = LLM(target).generate(prompts, params, use_tqdm=False)
    if draft == "random":
        draft = make_checkpoint("tiny", vocab_size=800, n_embd=32, n_head=2)
    spec = LLM(target, **draft_settings(draft))
    got = [spec.generate([p], params, use_tqdm=False)[0] for p in prompts]
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert [o.text for o in got] == [o.text for o in plain]
    stats = spec.scheduler.features.speculation.speculator.stats
    if draft == target:
        assert stats.acceptance_rate > 0.99
    elif draft == "minfer-tiny-llama-draft":  # trained on the same stories: right more often than not
        assert stats.num_draft_tokens > 20 and stats.acceptance_rate > 0.5, stats
    assert_all_free(spec)


# ---- the draft's cache holds the draft's K/V of every computed position ----------------------


def test_draft_cache_holds_what_the_draft_alone_computes(models):
    """Mid-generation, with rejections behind it, each running sequence's draft K/V at every position
    the proposer counts as valid is what the draft model computes for those tokens by itself (a plain
    engine on it). A sequence paused by the pause rule lags: it catches up when it speculates again."""
    target, draft = models["gpt2"]
    spec = LLM(target, block_size=4, **draft_settings(draft))
    sched = spec.scheduler
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, seed=0)
    for prompt in copy_prompts(3, 512, seed=9):
        sched.add_request(prompt_token_ids=prompt, sampling_params=params)
    for _ in range(15):
        sched.step()
    stats = sched.features.speculation.speculator.stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens  # accepts and rejects behind us
    reference = LLM(draft, block_size=4, enable_prefix_caching=False)
    checked = 0
    for seq in sched.running:
        n = sched.features.speculation.draft.num_valid(seq)
        if n == 0:
            continue  # paused since its prefill (the truncated draft is often wrong)
        ref_sched = reference.scheduler
        ref_id = ref_sched.add_request(prompt_token_ids=seq.token_ids[:n], sampling_params=SamplingParams(max_tokens=2))
        ref_sched.step()  # the whole prompt, one chunk
        (ref_seq,) = ref_sched.running
        got = sched.features.speculation.draft.kv_cache.kv[:, [slot_of(seq.block_table, p, 4) for p in range(n)]]
        want = ref_sched.kv_cache.kv[:, [slot_of(ref_seq.block_table, p, 4) for p in range(n)]]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        ref_sched.discard_request(ref_id)
        checked += 1
    assert checked > 0


def test_sequences_that_do_not_speculate_cost_the_draft_nothing(models):
    """Unseeded requests in a batch of more than MAX_BATCH do not speculate: the draft does not run at
    all. When the batch shrinks they speculate, the draft catching up on their whole sequence first."""
    from minfer.speculative.speculator import MAX_BATCH

    target, _ = models["gpt2"]
    spec = LLM(target, **draft_settings(target))
    sched = spec.scheduler
    calls = []
    forward = sched.features.speculation.draft._forward
    sched.features.speculation.draft._forward = lambda rows: calls.append(len(rows.ids)) or forward(rows)
    prompts = copy_prompts(MAX_BATCH + 4, 512, seed=12)
    params = [SamplingParams(max_tokens=8 if i % 2 else 40, temperature=0, ignore_eos=True) for i in range(len(prompts))]
    ids = [sched.add_request(prompt_token_ids=p, sampling_params=s) for p, s in zip(prompts, params)]
    while sched.has_unfinished():
        before = len(calls)
        sched.step()
        if len(sched.last_chunks) > MAX_BATCH:
            assert len(calls) == before  # nothing speculated: no draft forward
    assert max(calls) > 20  # a catch-up over a whole sequence
    got = [sched.pop_response(i).token_ids for i in ids]
    assert got == [o.token_ids for o in LLM(target).generate(prompts, params, use_tqdm=False)]
    assert sched.features.speculation.speculator.stats.acceptance_rate > 0.99
    assert_all_free(spec)


# ---- sampling stays the target's distribution; nothing leaks ---------------------------------


def test_rejection_sampling_with_a_draft_keeps_the_target_distribution(make_checkpoint):
    """As test_speculative's check, with a draft proposing: a vocabulary of 8 (logit_bias), 1200 seeded
    samples of 4 tokens, against the exact marginals."""
    path = make_checkpoint("tiny", seed=7)
    draft = make_checkpoint("tiny", seed=7, n_layer=1)
    assert_speculative_samples_match_exact(path, draft_settings(draft, k=2))


def test_seeded_sampling_with_a_draft_ignores_batch_neighbours(models):
    target, draft = models["gpt2"]
    assert_seeded_ignores_batch_neighbours(LLM(target, dtype="float64", **draft_settings(draft)))


# Temperatures that accept some proposals, not all: the draft has 21 of 267 accepted at 0.05 (at 0.3, 2 of 256 on a
# CPU, and none on a GPU, whose generators draw other numbers).
@pytest.mark.parametrize("method, temperature", [("ngram", 0.05), ("draft", 0.05)])
def test_seeded_sampling_is_plain_decodings_under_preemption(models, method, temperature):
    """Verification spends one draw of a seeded request's generator per emitted token, as plain decoding
    does: the same tokens with and without speculation, even where preemptions turn steps that would
    have speculated into plain recomputes (which broke seeds ignoring the batch before)."""
    target, draft = models["gpt2"]
    spec_settings = draft_settings(draft) if method == "draft" else {"speculative_method": "ngram"}
    prompts = copy_prompts(16, 512, seed=4, max_len=60)  # each fits in the cache; all 16 do not
    params = [SamplingParams(max_tokens=30, temperature=temperature, top_p=0.95, seed=i, ignore_eos=True) for i in range(16)]
    exact = {"num_kv_blocks": 40, "block_size": 4, "dtype": "float64"}  # float64: rounding moves no draw
    plain = LLM(target, **exact).generate(prompts, params, use_tqdm=False)
    spec = LLM(target, **exact, **spec_settings)
    got = spec.generate(prompts, params, use_tqdm=False)
    stats = spec.stats()
    assert stats["num_preemptions"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]  # rejections too
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert_all_free(spec)


def test_cancelled_and_finished_draft_requests_free_everything(models):
    target, draft = models["qwen3"]
    cancel_half_and_finish_the_rest(LLM(target, block_size=4, **draft_settings(draft)))


def test_profile_counts_the_draft_under_propose(models):
    from minfer.bench import step_timing

    target, draft = models["gpt2"]
    # Eager: on a GPU the verify step (a decode row per proposal) replays a CUDA graph, which marks no parts.
    spec = LLM(target, enforce_eager=True, **draft_settings(draft))
    sched = spec.scheduler
    sched.add_request(prompt_token_ids=copy_prompts(1, 512, seed=2)[0], sampling_params=SamplingParams(max_tokens=8, seed=1))
    sched.step()  # the prefill
    totals = step_timing.start_timing()
    try:
        sched.step()  # a speculating decode: the draft runs k forwards, then follows the target's
    finally:
        step_timing.stop_timing()
    assert sched.last_step.num_draft_tokens == 4
    assert totals["speculation: propose"] > 0 and totals["attention"] > 0
    assert all(v >= 0 for v in totals.values())
