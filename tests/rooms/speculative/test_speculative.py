"""Speculative decoding (speculative/): the n-gram proposer, verification of k + 1 rows in one forward,
greedy and rejection-sampling acceptance, rollback. Speculation may change speed, never results: greedy
output is token for token what plain decoding gives, in batches, under chunked prefill, prefix hits and
preemption; sampling draws from the target's distribution (a chi-square test); every block comes back."""

import random
from dataclasses import replace

import pytest
from speculation_checks import (
    SPEC,
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
from minfer.speculative.ngram import NgramProposer


# ---- the proposer and the options ----------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_longest_match():
    ngram = NgramProposer(1, 3)
    assert ngram.propose([1, 2, 3, 4, 5, 9, 2, 3], 3) == [4, 5, 9]  # "2 3" occurred before
    assert ngram.propose([7, 2, 3, 8, 1, 2, 3, 4, 2, 3], 2) == [4, 2]  # the latest of two matches
    assert ngram.propose([5, 1, 2, 3, 6, 9, 2, 3, 7, 1, 2, 3], 2) == [6, 9]  # "1 2 3" beats the later "2 3"
    assert ngram.propose([1, 2, 3, 4], 3) == []  # nothing repeats
    assert NgramProposer(2, 3).propose([1, 5, 2, 1], 3) == []  # a one-token match is too short
    assert ngram.propose([1, 2, 1, 2], 4) == [1, 2]  # only what exists after the match


def scan_for_ngram(token_ids, k, ngram_min, ngram_max):
    """The definition, by brute force: the latest earlier occurrence of the longest suffix."""
    L = len(token_ids)
    for n in range(min(ngram_max, L - 1), ngram_min - 1, -1):
        for start in range(L - n - 1, -1, -1):
            if token_ids[start : start + n] == token_ids[L - n :]:
                return token_ids[start + n : start + n + k]
    return []


def test_ngram_index_kept_per_sequence_equals_a_fresh_scan_at_every_length():
    """The proposer extends a sequence's index token by token; at every length it must propose what a
    scan of the whole list would (small vocabularies, so matches of every length occur)."""
    rng = random.Random(0)

    class Key:  # stands for a Sequence: any object a weak reference can point to
        pass

    for vocab, ngram_min, ngram_max in [(3, 1, 3), (5, 2, 4), (8, 2, 2)]:
        ngram, key, tokens = NgramProposer(ngram_min, ngram_max), Key(), [rng.randrange(vocab) for _ in range(5)]
        for _ in range(200):
            k = rng.randint(1, 5)
            assert ngram.propose(tokens, k, key=key) == scan_for_ngram(tokens, k, ngram_min, ngram_max)
            tokens.append(rng.randrange(vocab) if rng.random() < 0.7 else rng.choice(tokens))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"speculative_method": "medusa"}, "--speculative-method must be one of ngram, draft"),
        ({"num_speculative_tokens": 4}, "--num-speculative-tokens applies only with --speculative-method"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "--num-speculative-tokens must be a positive"),
        ({"speculative_method": "ngram", "ngram_min": 4, "ngram_max": 2}, r"--ngram-min \(4\) must be <= --ngram-max"),
        ({"speculative_method": "ngram", "speculative_model": "x"}, "--speculative-model applies to"),
    ],
)
def test_bad_options_are_refused_naming_the_flag(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_defaults_and_flags():
    config = EngineConfig(speculative_method="ngram")
    assert (config.num_speculative_tokens, config.ngram_min, config.ngram_max) == (4, 2, 4)
    assert "--speculative-method" in config.to_cli_args() and "--num-speculative-tokens" in config.to_cli_args()


# ---- greedy: token for token what plain decoding gives -----------------------------------


@pytest.fixture(scope="module")
def models(make_checkpoint):
    from minfer.models.loader import BUILTIN_MODELS

    return {"gpt2": make_checkpoint(), "qwen3": make_checkpoint("qwen3-tiny", seed=2),
            "minfer-tiny-llama": BUILTIN_MODELS["minfer-tiny-llama"]}


@pytest.mark.parametrize("family", ["gpt2", "qwen3", "minfer-tiny-llama"])
def test_greedy_batch_of_32_equals_plain_and_alone(models, family):
    """Random checkpoints on random prompts that repeat a stretch; the shipped model that copies on
    bench's copy prompts (held-out stories, then the first one's opening again)."""
    from minfer.bench.workload import copy_texts

    path = models[family]
    plain_llm = LLM(path, block_size=8)
    if family == "minfer-tiny-llama":
        prompts = [plain_llm.tokenizer.encode_prompt(text) for text in copy_texts(path, 32)]
    else:
        prompts = copy_prompts(32, 512, seed=1)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    plain = plain_llm.generate(prompts, params, use_tqdm=False)
    # Chunked prefill (a small token budget), a small cache (preemptions), small blocks.
    spec = LLM(path, block_size=8, max_num_batched_tokens=64, num_kv_blocks=120, **SPEC)
    outs = run_stepwise(spec, prompts, half_seeded(params, len(prompts)))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    stats = spec.scheduler.features.speculation.speculator.stats
    assert stats.num_accepted_tokens > 50 and stats.num_draft_tokens > stats.num_accepted_tokens  # both ways
    assert spec.scheduler.num_preemptions > 0 and spec.scheduler.recompute_cache_hit_tokens > 0  # recomputes hit
    assert_all_free(spec)
    assert_cache_holds_only_kept_tokens(spec, outs)
    alone = spec.generate(prompts[5], params, use_tqdm=False)[0]
    assert alone.token_ids == plain[5].token_ids


def test_prefix_hits_on_speculated_blocks(models):
    """A request whose prompt is an earlier request's prompt and output reuses the blocks speculation
    filled, and still continues as plain decoding does."""
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = copy_prompts(4, 512, seed=3)
    spec, plain = LLM(models["gpt2"], block_size=4, **SPEC), LLM(models["gpt2"], block_size=4)
    first = spec.generate(prompts, params, use_tqdm=False)
    assert_cache_holds_only_kept_tokens(spec, first)
    again = [o.prompt_token_ids + o.token_ids for o in first]
    got = spec.generate(again, params, use_tqdm=False)
    assert spec.scheduler.prefix_cache_hit_tokens > 100
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(again, params, use_tqdm=False)]
    assert_all_free(spec)


@pytest.mark.parametrize("name, accepted", [("minfer-tiny", 10), ("minfer-tiny-llama", 50)])
def test_trained_tiny_copy_heavy_greedy_equals_plain(name, accepted):
    """The shipped trained models on bench's copy prompt: plain decoding's tokens. minfer-tiny-llama,
    which copies, keeps most of 100 tokens' proposals; minfer-tiny only some."""
    from minfer.bench.workload import copy_texts
    from minfer.models.loader import BUILTIN_MODELS

    (prompt,) = copy_texts(BUILTIN_MODELS[name], 1)
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    plain = LLM(name).generate([prompt], params, use_tqdm=False)[0]
    spec = LLM(name, speculative_method="ngram")
    got = spec.generate([prompt], params, use_tqdm=False)[0]
    assert got.token_ids == plain.token_ids and got.text == plain.text
    assert spec.scheduler.features.speculation.speculator.stats.num_accepted_tokens > accepted
    assert_all_free(spec)


# ---- sampling controls, stops and logprobs at every verified position ------------------------


def test_controls_stops_and_logprobs_apply_at_every_verified_position(models):
    prompts = copy_prompts(12, 512, seed=4)
    plain, spec = LLM(models["gpt2"]), LLM(models["gpt2"], **SPEC)
    first = plain.generate(prompts[:1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False)
    some_output = first[0].token_ids
    params = [
        SamplingParams(max_tokens=30, temperature=0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, frequency_penalty=0.5, presence_penalty=0.3, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, logit_bias={some_output[3]: -100.0, 7: 5.0}, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, min_tokens=10, stop_token_ids=[some_output[2]]),
        SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[some_output[6]]),  # stops mid-draft
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),  # max_tokens inside a draft
        SamplingParams(max_tokens=30, temperature=0, logprobs=3, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, stop=["a"], ignore_eos=True),
    ]
    prompts = [prompts[0]] * len(params) + prompts[1:5]
    params += [SamplingParams(max_tokens=30, temperature=0, logprobs=0, ignore_eos=True)] * 4
    want = plain.generate(prompts, params, use_tqdm=False)
    got = run_stepwise(spec, prompts, [replace(p, seed=1) for p in params])  # seeded: speculating in any batch
    for w, g in zip(want, got):
        assert g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason
        if w.logprobs is not None:
            assert len(g.logprobs) == len(w.logprobs) == len(w.token_ids)
            for a, b in zip(g.logprobs, w.logprobs):
                assert a.token_id == b.token_id and a.rank == b.rank
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    assert got[4].finish_reason == "stop" and len(got[5].token_ids) == 7
    assert spec.scheduler.features.speculation.speculator.stats.num_accepted_tokens > 0
    assert_all_free(spec)


# ---- sampling: seeded results ignore the batch; the distribution is the target's ------------


def test_seeded_sampling_with_speculation_ignores_batch_neighbours(models):
    assert_seeded_ignores_batch_neighbours(LLM(models["gpt2"], dtype="float64", **SPEC))


def test_greedy_n_above_one(models):
    spec, plain = LLM(models["gpt2"], **SPEC), LLM(models["gpt2"])
    params = SamplingParams(max_tokens=30, temperature=0, n=2, ignore_eos=True)
    prompts = copy_prompts(3, 512, seed=6)
    want = plain.generate(prompts, params, use_tqdm=False)
    got = spec.generate(prompts, half_seeded(params, 3), use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert spec.scheduler.features.speculation.speculator.stats.num_accepted_tokens > 0
    assert_all_free(spec)


def test_rejection_sampling_keeps_the_target_distribution(make_checkpoint):
    """A vocabulary of 8 (logit_bias +100 on tokens 0-7 leaves the others e^-90 of a chance): 1200 seeded
    samples of 4 tokens, with speculation, against the exact marginals."""
    path = make_checkpoint("tiny", seed=7)
    spec_options = {"speculative_method": "ngram", "num_speculative_tokens": 2, "ngram_min": 1, "ngram_max": 2}
    stats = assert_speculative_samples_match_exact(path, spec_options)
    assert stats.accepted_length_counts[3] > 0  # both proposals accepted, then a bonus token drawn


# ---- no leak -----------------------------------------------------------------------------


def test_cancelled_speculating_requests_free_everything(models):
    cancel_half_and_finish_the_rest(LLM(models["gpt2"], block_size=4, **SPEC))


# ---- observability: /metrics, the engine feed, bench.py --------------------------------------


def test_server_streams_plain_greedy_and_counts_proposals(models):
    from serving import AUTH, call, metrics, serving, stream_events

    prompt = copy_prompts(1, 512, seed=11)[0]  # one on which proposals are accepted
    want = LLM(models["gpt2"]).generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    with serving(EngineConfig(model=str(models["gpt2"]), **SPEC)) as srv:
        port = srv.server_address[1]
        name = call(port, "GET", "/v1/models", headers=AUTH)[2]["data"][0]["id"]
        body = {"model": name, "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "logprobs": 1}
        events = stream_events(port, "/v1/completions", body)
        status, _, full = call(port, "POST", "/v1/completions", {**body, "logprobs": None}, headers=AUTH)
        counts = metrics(port)
    text = "".join(e["choices"][0]["text"] for e in events if e != "[DONE]")
    streamed = sum(len(e["choices"][0]["logprobs"]["tokens"]) for e in events if e != "[DONE]" and e["choices"][0]["logprobs"])
    assert status == 200 and text == full["choices"][0]["text"] == want[0].text and streamed == 40
    drafts = counts["minfer_spec_decode_num_drafts_total"]
    accepted = counts["minfer_spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and 0 < accepted <= counts["minfer_spec_decode_num_draft_tokens_total"]
    assert counts["minfer_spec_decode_accepted_length_count"] == drafts
    assert counts["minfer_spec_decode_accepted_length_sum"] == drafts + accepted
    assert sum(v for k, v in counts.items() if k.startswith("minfer_spec_decode_num_accepted_tokens_per_pos")) == accepted
    assert counts["minfer_generation_tokens_total"] == 80  # accepted proposals count as generated tokens


def test_engine_feed_reports_each_steps_proposals(models):
    from minfer.server.engine_events import EventRecorder

    spec = LLM(models["gpt2"], **SPEC)
    recorder = EventRecorder(spec.scheduler)
    sched = spec.scheduler
    sched.add_request(prompt_token_ids=copy_prompts(1, 512, seed=10)[0], sampling_params=SamplingParams(max_tokens=30))
    events = []
    while sched.has_unfinished():
        sampled = sched.step()
        events.append(recorder.step(len(sampled), []))
    assert sum(e["num_draft_tokens"] for e in events) == sched.features.speculation.speculator.stats.num_draft_tokens > 0
    assert sum(e["num_accepted_tokens"] for e in events) == sched.features.speculation.speculator.stats.num_accepted_tokens


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_bench_copy_workload_reports_acceptance(capsys, tmp_path, mode):
    from minfer.bench import cli as bench

    argv = ["--model", "minfer-tiny", "--workload", "copy", "--num-requests", "2", "--output-len", "24",
            "--max-concurrency", "1", "--disable-tqdm", "--mode", mode, "--json", tmp_path / "b.json",
            "--speculative-method", "ngram", "--num-speculative-tokens", "3"]  # fmt: skip
    assert bench.main([str(a) for a in argv]) == 0
    out = capsys.readouterr().out
    assert "Mean accepted length:" in out and "Acceptance rate:" in out
    import json

    summary = json.loads((tmp_path / "b.json").read_text())["summary"]
    assert summary["spec_num_draft_tokens"] > 0 and summary["total_output_tokens"] == 48
    rate = summary["spec_num_accepted_tokens"] / summary["spec_num_draft_tokens"]
    assert summary["spec_acceptance_rate"] == pytest.approx(rate)


def test_unseeded_requests_speculate_only_in_small_batches(models):
    from minfer.speculative.speculator import MAX_BATCH

    spec = LLM(models["gpt2"], **SPEC)
    sched = spec.scheduler
    prompts = copy_prompts(MAX_BATCH + 4, 512, seed=12)
    for i, p in enumerate(prompts):  # the short ones finish first, and leave a small batch
        sched.add_request(prompt_token_ids=p, sampling_params=SamplingParams(max_tokens=8 if i % 2 else 60, temperature=0))
    seen = []
    while sched.has_unfinished():
        sched.step()
        seen.append((len(sched.last_chunks), sched.last_step.num_draft_tokens))
    assert all(drafted == 0 for running, drafted in seen if running > MAX_BATCH)
    assert any(drafted > 0 for running, drafted in seen)  # the last ones, once few are left
