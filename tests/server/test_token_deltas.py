"""Per-token outputs: after each step that samples a token for a request, the engine worker sends its
handler one CompletionDelta with the new token ids and the text they added. Over a request the deltas
add up to its RequestOutput, and the stream built from them is what it always was."""

import pytest

from minfer import OnlineScheduler, SamplingParams
from minfer.engine.outputs import CompletionDelta
from minfer.models.gpt2 import GPT2
from minfer.server.manager import SchedulerManager
from minfer.server.messages import Accepted, Done
from minfer.server.requests import ParsedRequest
from minfer.server.responder import Responder
from minfer.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def parts(tiny_checkpoint):
    return GPT2.from_pretrained(tiny_checkpoint), Tokenizer.from_dir(tiny_checkpoint)


def run(parts, requests):
    """Submit (prompt ids, params) pairs to a manager; return each one's events, Accepted to Done."""
    model, tokenizer = parts
    # A 32-token budget: a long prompt prefills in chunks, and only its last chunk samples a token.
    manager = SchedulerManager(OnlineScheduler(model, tokenizer, num_kv_blocks=64, max_num_batched_tokens=32))
    manager.start()
    try:
        handles = [manager.submit(manager.check(ids, params)) for ids, params in requests]
        results = []
        for handle in handles:
            events = [handle.next_event(timeout=60)]
            while not isinstance(events[-1], Done):
                assert events[-1] is not None, "timed out"
                events.append(handle.next_event(timeout=60))
            manager.release(handle)
            results.append(events)
        return results
    finally:
        manager.shutdown()


def test_one_delta_per_sampled_token_adding_up_to_the_output(parts):
    tokenizer = parts[1]
    long_prompt = list(range(1, 101))  # 100 tokens: four chunks, the first three sample nothing
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for events in run(parts, [(long_prompt, params), ([5, 6, 7], params)]):
        assert events[0] == Accepted() and all(isinstance(e, CompletionDelta) for e in events[1:-1])
        deltas, out = events[1:-1], events[-1].outputs[0]
        assert [d.token_ids for d in deltas] == [[t] for t in out.token_ids], "one delta per step that sampled"
        assert "".join(d.text for d in deltas) == out.text == tokenizer.decode(out.token_ids)
        assert [d.finish_reason for d in deltas] == [None] * 11 + ["length"]
        assert {d.index for d in deltas} == {0} and all(d.logprobs is None for d in deltas)


def test_deltas_hold_back_a_stop_string_and_carry_a_stop_token(parts):
    model, tokenizer = parts
    reference = OnlineScheduler(model, tokenizer, num_kv_blocks=64)
    rid = reference.add_request("Hello", sampling_params=SamplingParams(max_tokens=30, temperature=0))
    while reference.has_unfinished():
        reference.step()
    free = reference.pop_response(rid)
    stop_string = free.text[len(free.text) // 2 :][:3]
    stop_token = free.token_ids[8]
    ids = tokenizer.encode_prompt("Hello")
    by_string, by_token = run(
        parts,
        [
            (ids, SamplingParams(max_tokens=30, temperature=0, stop=[stop_string])),
            (ids, SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_token])),
        ],
    )
    deltas, out = by_string[1:-1], by_string[-1].outputs[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop_string)]
    assert [t for d in deltas for t in d.token_ids] == out.token_ids and len(deltas) == len(out.token_ids)
    streamed = ""
    for d in deltas:
        streamed += d.text
        assert stop_string not in streamed
    assert streamed == out.text and deltas[-1].finish_reason == "stop"

    deltas, out = by_token[1:-1], by_token[-1].outputs[0]
    assert out.token_ids == free.token_ids[: free.token_ids.index(stop_token) + 1]
    assert deltas[-1].token_ids == [stop_token] and deltas[-1].finish_reason == "stop"  # its text never shows
    assert "".join(d.text for d in deltas) == out.text


def test_get_new_output_hands_out_each_token_once(parts):
    sched = OnlineScheduler(*parts, num_kv_blocks=64)
    rid = sched.add_request(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(max_tokens=3, temperature=0))
    assert sched.get_new_output(rid) == CompletionDelta(0, [], "")  # nothing sampled yet
    first = sched.step()[rid]
    assert sched.get_new_output(rid).token_ids == [first]
    assert sched.get_new_output(rid) == CompletionDelta(0, [], "")
    sched.step()
    sched.step()
    last = sched.get_new_output(rid)
    assert len(last.token_ids) == 2 and last.finish_reason == "length"
    sched.pop_finished_ids()
    assert sched.pop_response(rid).token_ids == [first, *last.token_ids]


def test_delta_chunks_are_the_text_chunks_of_before(parts):
    for chat in (False, True):
        r = Responder("tiny", chat, ParsedRequest([[1, 2]], SamplingParams(n=3)), parts[1])
        [text] = r.delta_chunks(CompletionDelta(0, [7], "ab"))
        choice = text["choices"][0]
        assert (choice["delta"]["content"] if chat else choice["text"]) == "ab" and choice["finish_reason"] is None
        assert r.delta_chunks(CompletionDelta(0, [7, 8], "")) == []  # text held back: no empty chunk
        assert r.delta_chunks(CompletionDelta(2, [7], "c"))[0]["choices"][0]["index"] == 2
        last = r.delta_chunks(CompletionDelta(1, [7], "", "stop"))  # a choice's last delta: its finish_reason
        [final] = last
        assert final["choices"][0]["index"] == 1 and final["choices"][0]["finish_reason"] == "stop"
        assert final["choices"][0] == ({"index": 1, "delta": {}, "logprobs": None, "finish_reason": "stop"} if chat
                                       else {"index": 1, "text": "", "logprobs": None, "finish_reason": "stop"})
