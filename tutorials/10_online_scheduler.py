"""Stage 10: the online scheduler: continuous batching, chunked prefill and preemption.

Drives minfer.scheduler.OnlineScheduler step by step, the way a server does:
add_request whenever a request arrives, step() to run one batch, then
pop_finished_ids / pop_response to collect what finished. A table shows, for every
step, what each request did (prefill chunk, decode, waiting), so you can watch
requests join and leave the batch. Then a cache too small for everyone forces
preemptions, and discard_request drops a request mid-flight. Throughout, the
outputs must equal those of each request run alone, and no KV block may leak.

    python tutorials/10_online_scheduler.py   # MINFER_MODEL=/path to choose the checkpoint
"""

import time

from _common import model_path, section
from minfer import OnlineScheduler, SamplingParams
from minfer.model import GPT2
from minfer.sequence import Status
from minfer.tokenizer import Tokenizer

path = model_path()
model = GPT2.from_pretrained(path)
tokenizer = Tokenizer.from_dir(path)
words = tokenizer.encode("Continuous batching lets a request join the running batch at any step. ")


def prompt(length: int, offset: int = 0) -> list[int]:
    """Exactly `length` token ids (the same lengths on any tokenizer); offsets give different prompts."""
    return (words * (length // len(words) + offset + 2))[offset : offset + length]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # exactly n tokens


def run_alone(prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """The reference: the request by itself, on a scheduler of its own."""
    solo = OnlineScheduler(model, tokenizer, num_kv_blocks=64, max_num_seqs=1)
    rid = solo.add_request(prompt_token_ids=prompt_ids, sampling_params=params)
    while solo.has_unfinished():
        solo.step()
    return solo.pop_response(rid).token_ids


def run(sched: OnlineScheduler, arrivals: dict[int, list[tuple]], width: int = 13) -> tuple[dict, list[dict]]:
    """Drive the scheduler as a server's loop does, printing one row per step (runs of alike rows
    are folded). arrivals: step number -> [(name, prompt ids, params)] added just before that step.
    Returns {name: RequestOutput} and, per step, {name: what it did}."""
    rid_of, outputs, history = {}, {}, []
    names = [name for step in sorted(arrivals) for name, _, _ in arrivals[step]]
    print("step | " + "".join(f"{n:<{width}}" for n in names) + "| prefill+decode tokens, blocks in use")
    folded, step = 0, 0
    while step == 0 or sched.has_unfinished():
        step += 1
        for name, ids, params in arrivals.get(step, []):  # requests arrive between steps
            rid_of[name] = sched.add_request(prompt_token_ids=ids, sampling_params=params)
        seqs = {n: sched.requests[r].seq for n, r in rid_of.items() if r in sched.requests}  # not finished yet
        before = {n: (s.num_computed_tokens, s.num_preemptions, s.status) for n, s in seqs.items()}
        sched.step()  # one forward pass for every scheduled token; returns {request_id: token}
        did = {}
        for name, seq in seqs.items():
            computed, preemptions, status = before[name]
            admitted = status is Status.WAITING and seq.status is not Status.WAITING
            if admitted:
                computed = seq.num_cached_tokens  # whatever the prefix cache (stage 09) already had
            if seq.num_preemptions > preemptions:
                did[name] = "PREEMPTED"
            elif seq.status is Status.WAITING:
                did[name] = "waiting"
            elif not admitted and computed >= seq.num_prompt_tokens and seq.num_computed_tokens == computed + 1:
                did[name] = "decode"
            else:  # a prompt chunk, or the recompute of a preempted sequence
                did[name] = f"pre {computed}:{seq.num_computed_tokens}"
            if seq.is_finished:
                did[name] += " done"
        for rid in sched.pop_finished_ids():  # collect what finished; the scheduler then forgets it
            name = next(n for n, r in rid_of.items() if r == rid)
            outputs[name] = sched.pop_response(rid)
        s = sched.last_step
        history.append(did)
        assert s.num_prefill_tokens + s.num_decode_tokens <= sched.max_num_batched_tokens
        assert s.num_seqs <= sched.max_num_seqs
        row = "".join(f"{did.get(n, ''):<{width}}" for n in names)
        row += f"| {s.num_prefill_tokens:3} + {s.num_decode_tokens}, {s.kv_blocks_used:2} blocks"
        if len(history) > 1 and did == history[-2] and sched.has_unfinished():
            folded += 1  # the same as the step before: fold it
            continue
        if folded:
            print(f"     | ... {folded} more step{'s' * (folded > 1)} like the one above")
            folded = 0
        print(f"{step:4} | {row}")
    return outputs, history


def steps_of(history: list[dict], name: str, kind: str) -> list[int]:
    """1-based step numbers in which `name` did `kind` ("pre", "decode", "PREEMPTED")."""
    return [i + 1 for i, h in enumerate(history) if h.get(name, "").startswith(kind)]


# ---------------------------------------------------------------------------------------
section("continuous batching with chunked prefill: max_num_seqs=3, max_num_batched_tokens=32")
sched = OnlineScheduler(model, tokenizer, block_size=16, num_kv_blocks=64, max_num_seqs=3, max_num_batched_tokens=32)
requests = {
    1: [("A", prompt(10, 0), greedy(6)), ("B", prompt(12, 1), greedy(10)), ("C", prompt(70, 2), greedy(4))],
    3: [("D", prompt(8, 3), greedy(5))],  # arrives while A, B, C run: waits for a free slot
    5: [("E", prompt(9, 4), greedy(3))],
}
t0 = time.perf_counter()
outs, history = run(sched, requests)
print(f"{len(history)} steps, {time.perf_counter() - t0:.2f} s")

# Chunked prefill: C's 70-token prompt does not fit the 32-token budget, so it is split over
# several steps, and A and B keep decoding in those same steps instead of stalling behind it.
c_prefill = steps_of(history, "C", "pre")
assert len(c_prefill) >= 3, c_prefill
assert any(history[s - 1].get("A") == "decode" for s in c_prefill), "decodes run alongside a prefill chunk"
# Continuous batching: D waited for a slot; it was admitted the step after the first request finished,
# and ran next to requests that had started long before it.
first_done = min(i + 1 for i, h in enumerate(history) if any(v.endswith("done") for v in h.values()))
assert steps_of(history, "D", "pre")[0] == first_done + 1
assert set(steps_of(history, "D", "decode")) & set(steps_of(history, "B", "decode")), "D and B share steps"
for name, ids, params in (r for rs in requests.values() for r in rs):
    assert outs[name].token_ids == run_alone(ids, params), f"{name}: batching must not change the output"
print("every output equals the same request run alone")
assert sched.allocator.num_free_blocks == sched.allocator.num_blocks
sched.check_invariants()

# ---------------------------------------------------------------------------------------
section("preemption: 3 requests that need 3 blocks each, on a cache of 8 blocks")
small = OnlineScheduler(model, tokenizer, block_size=16, num_kv_blocks=8, max_num_seqs=4, max_num_batched_tokens=64)
requests = {1: [(name, prompt(20, 5 + i), greedy(20)) for i, name in enumerate("XYZ")]}  # 20 + 20 tokens: 3 blocks
outs, history = run(small, requests)
print({name: (o.num_preemptions, o.num_cached_tokens) for name, o in outs.items()}, "(preemptions, cached tokens)")
assert small.num_preemptions > 0 and sum(o.num_preemptions for o in outs.values()) == small.num_preemptions
# The newest running request is the one preempted: it frees its blocks and waits at the queue's front.
assert steps_of(history, "Z", "PREEMPTED") and not steps_of(history, "X", "PREEMPTED")
# Its 2 full blocks stayed in the prefix cache (stage 09) while it waited: the recompute found them.
assert outs["Z"].num_cached_tokens == 32
for name, ids, params in requests[1]:
    assert outs[name].token_ids == run_alone(ids, params), f"{name}: preemption must not change the output"
print("every output equals the same request run alone, preemptions and all")
assert small.allocator.num_free_blocks == 8
small.check_invariants()

# ---------------------------------------------------------------------------------------
section("discard_request: a request dropped mid-flight frees its blocks at once")
rid = small.add_request(prompt_token_ids=prompt(40), sampling_params=greedy(40))
small.step()
small.step()
used = small.allocator.num_blocks - small.allocator.num_free_blocks
print(f"after 2 steps it holds {used} blocks; stats {small.stats()}")
assert used > 0 and small.discard_request(rid)
print(f"discarded; stats {small.stats()}")
assert small.allocator.num_free_blocks == 8 and not small.has_unfinished()
assert small.discard_request(rid) is False  # unknown now: nothing to do
small.check_invariants()
print(
    "\nOK: requests join and leave every step, prompts are chunked, preemption recomputes, "
    "outputs never change, and every block comes back."
)
