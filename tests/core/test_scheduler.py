"""OnlineScheduler (engine/scheduler.py, tutorial stage 10) as a server drives it: requests added, steps run
with the invariants checked after each, finished ones popped once, any request discarded at any point, stop
tokens and stop strings (held back while they may still match a stream), and requests that could never run
refused; after each, every KV block is free."""

import pytest
from engine_checks import GREEDY, assert_all_free, random_prompts

from minfer import LLM, SamplingParams
from minfer.text.text_stream import TextStream


def test_invariants_hold_after_every_step(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, num_kv_blocks=30, max_num_seqs=8, max_num_batched_tokens=40)
    sched = llm.scheduler
    prompts = random_prompts(12, 512, seed=1, max_len=120)
    ids = [sched.add_request(prompt_token_ids=p, sampling_params=GREEDY) for p in prompts]
    finished = []
    while sched.has_unfinished():
        sched.step()
        sched.check_invariants()
        finished += sched.pop_finished_ids()
    assert sorted(finished) == sorted(ids) and sched.num_preemptions > 0
    assert sched.pop_finished_ids() == []  # finished events are handed out once
    for i in ids:
        assert sched.is_finished(i) and len(sched.get_generated_ids(i)) <= 32
        sched.pop_response(i)
    assert_all_free(llm)


def test_discard_frees_blocks_at_once(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, num_kv_blocks=64, max_num_seqs=4)
    sched = llm.scheduler
    ids = [sched.add_request(prompt_token_ids=p, sampling_params=GREEDY) for p in random_prompts(8, 512, seed=2)]
    for _ in range(3):
        sched.step()
    running = [i for i in ids if sched.get_step_count(i) > 0 and not sched.is_finished(i)]
    waiting = [i for i in ids if sched.get_step_count(i) == 0]
    assert running and waiting
    for i in running[:2] + waiting[:2]:
        assert sched.discard_request(i)
        sched.check_invariants()
    assert not sched.discard_request(running[0])  # already gone
    assert not sched.discard_request("no-such-request")
    with pytest.raises(KeyError, match="unknown request id"):
        sched.get_generated_ids(running[0])
    for i in ids:  # discard everything else mid-flight too
        sched.discard_request(i)
    assert_all_free(llm)


def test_a_request_discarded_after_it_finished_is_not_reported_finished(tiny_checkpoint):
    sched = LLM(tiny_checkpoint, num_kv_blocks=64).scheduler
    done = sched.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=1))
    kept = sched.add_request(prompt_token_ids=[4, 5, 6], sampling_params=SamplingParams(max_tokens=1))
    sched.step()
    assert sched.is_finished(done) and sched.is_finished(kept)
    assert sched.discard_request(done)  # finished, not yet popped: the caller no longer wants it
    assert sched.pop_finished_ids() == [kept]  # else pop_responses(done) would raise: the scheduler forgot it
    sched.pop_responses(kept)
    again = sched.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=1),
                              request_id=done)  # the id, free again, names a new request
    assert sched.pop_finished_ids() == [] and not sched.is_finished(again)


def test_a_step_that_fails_after_finishing_a_sequence_leaves_it_discardable(tiny_checkpoint, monkeypatch):
    """A step can fail between recording a sequence's last token (it is finished) and retiring it (its blocks
    freed): discard_request went by its status, found it finished, and left it running, holding its blocks.
    The server's worker discards whatever a failed step had in flight: the next step failed on it again, forever."""
    llm = LLM(tiny_checkpoint, num_kv_blocks=64)
    sched = llm.scheduler
    rid = sched.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=1))

    def failing_flush(self, check_stop=True):  # runs once the sequence has its last token, before it is retired
        raise RuntimeError("boom")

    monkeypatch.setattr(TextStream, "flush", failing_flush)
    with pytest.raises(RuntimeError, match="boom"):
        sched.step()
    assert sched.discard_request(rid)
    assert not sched.has_unfinished()
    assert_all_free(llm)


def test_a_discard_that_failed_midway_can_be_tried_again(tiny_checkpoint):
    """discard_request forgot the request before dropping its sequences: one that failed midway left them running,
    holding their blocks, and a second try (the server's, after the failure) found no such request to discard."""
    llm = LLM(tiny_checkpoint, num_kv_blocks=64)
    sched = llm.scheduler
    rid = sched.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=10))
    sched.step()  # running, holding blocks
    real_discard = sched.batcher.discard

    def failing_discard(seq):
        sched.batcher.discard = real_discard
        raise RuntimeError("boom")

    sched.batcher.discard = failing_discard
    with pytest.raises(RuntimeError, match="boom"):
        sched.discard_request(rid)
    assert sched.discard_request(rid)
    assert_all_free(llm)


def test_stops(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, num_kv_blocks=64)
    prompt = "The cache is cut into blocks"
    free_run = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), use_tqdm=False)[0]
    assert free_run.finish_reason == "length" and len(free_run.token_ids) == 40
    assert free_run.text == llm.tokenizer.decode(free_run.token_ids)

    stop_token = free_run.token_ids[10]
    first = free_run.token_ids.index(stop_token)
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[stop_token]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == free_run.token_ids[: first + 1]
    assert out.text == llm.tokenizer.decode(free_run.token_ids[:first])  # the stop token's text is left out

    text = free_run.text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    out = llm.generate(
        [prompt], SamplingParams(max_tokens=40, temperature=0, stop=["\x00never", stop]), use_tqdm=False
    )[0]
    assert out.finish_reason == "stop" and out.text == text[: text.index(stop)]


def test_streamed_text_holds_back_a_possible_stop_string(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, num_kv_blocks=64)
    free_run = llm.generate(["Hello"], SamplingParams(max_tokens=30, temperature=0), use_tqdm=False)[0]
    stop = free_run.text[-6:-1]
    sched = llm.scheduler
    rid = sched.add_request("Hello", sampling_params=SamplingParams(max_tokens=30, temperature=0, stop=stop))
    pieces = []
    while sched.has_unfinished():
        sched.step()
        pieces.append(sched.get_new_output(rid).text)
        assert stop not in "".join(pieces)
    response = sched.pop_response(rid)
    assert "".join(pieces) == response.text == free_run.text[: free_run.text.index(stop)]
    assert response.first_token_time >= response.arrival_time
    assert len(response.token_times) == len(response.token_ids) and response.finish_time >= response.token_times[-1]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(prompt_token_ids=[]), "prompt is empty"),
        (dict(prompt=""), "prompt is empty"),
        (dict(prompt_token_ids=[1, 512]), "token id 512 is not in the vocabulary"),
        (dict(prompt_token_ids=[-1]), "token id -1"),
        (dict(prompt="a", prompt_token_ids=[1]), "exactly one of"),
        (dict(prompt="a \ud800"), "lone UTF-16 surrogate"),  # a str, but not text (the tokenizer's TypeError)
        (
            dict(prompt_token_ids=[1] * 500, sampling_params=SamplingParams(max_tokens=13)),
            "exceeds the model's context",
        ),
        (dict(prompt_token_ids=[1] * 300, sampling_params=SamplingParams(max_tokens=100)), "needs 25 KV blocks"),
    ],
)


def test_requests_that_can_never_run_are_refused(tiny_checkpoint, kwargs, message):
    llm = LLM(tiny_checkpoint, num_kv_blocks=24)
    with pytest.raises(ValueError, match=message):
        llm.scheduler.add_request(**kwargs)
    assert_all_free(llm)


@pytest.mark.parametrize("max_model_len, num_kv_blocks, room", [(64, 8, 64), (100, 3, 48)])
def test_max_tokens_none_generates_until_the_context_or_the_cache_is_full(tiny_checkpoint, max_model_len,
                                                                          num_kv_blocks, room):
    """vLLM's max_tokens=None: as many tokens as the context leaves after each prompt, and never more than the
    KV cache holds (3 blocks of 16: 48 tokens)."""
    llm = LLM(tiny_checkpoint, max_model_len=max_model_len, num_kv_blocks=num_kv_blocks, block_size=16)
    params = SamplingParams(max_tokens=None, ignore_eos=True)
    prompts = [[1, 2, 3], list(range(5, 25))]
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [room - 3, room - 20] and {o.finish_reason for o in outs} == {"length"}
    assert params.max_tokens is None  # the caller's params, shared by both prompts, are left as they were
    with pytest.raises(ValueError, match=f"^prompt \\({room} tokens\\) leaves no room for output in the {room} "):
        llm.generate([[1] * room], params, use_tqdm=False)
    assert_all_free(llm)
