"""Stage 10: the online scheduler: continuous batching, chunked prefill and preemption.

Drives minfer.scheduler.OnlineScheduler step by step, the way a server does:
add_request whenever a request arrives, step() to run one batch, then
pop_finished_ids / pop_response to collect what finished. A table shows, for every
step, what each request did (prefill chunk, decode, waiting), so you can watch
requests join and leave the batch. Then a cache too small for everyone forces
preemptions, and discard_request drops a request mid-flight. Throughout, the
outputs must equal those of each request run alone, and no KV block may leak.
Last, the part under the scheduler: ModelRunner.prepare builds stage 08's attention
metadata from real sequences, the whole model runs on it (GPT2.forward given a
PagedBatch), and its logits must equal the plain GPT2.forward of stage 01: a
prompt run in chunks, and a step that mixes decodes and prefills of four sequences.

    python tutorials/10_online_scheduler.py   # MINFER_MODEL=/path to choose the checkpoint
    python tutorials/10_online_scheduler.py --exercise   # with your admit and preempt (tutorials/exercises/)
"""

import random

import torch
from _common import exercise, model_path, section

from minfer import OnlineScheduler, SamplingParams
from minfer.attention.kv_cache import KVCache, cdiv
from minfer.attention.torch_sdpa import TorchBackend, group_by_length
from minfer.engine.block_allocator import BlockAllocator
from minfer.engine.continuous_batcher import ContinuousBatcher
from minfer.engine.model_runner import ModelRunner
from minfer.engine.sequence import ScheduledChunk, Sequence, Status
from minfer.models.gpt2 import GPT2
from minfer.text.tokenizer import Tokenizer

graded = exercise("10")  # --exercise: your admit and preempt (tutorials/exercises/) run instead of minfer's
path = model_path()
model = GPT2.from_pretrained(path)
tokenizer = Tokenizer.from_dir(path)
words = tokenizer.encode("Continuous batching lets a request join the running batch at any step. ")


def prompt(length: int, offset: int = 0) -> list[int]:
    """Exactly `length` token ids (the same lengths on any tokenizer); offsets give different prompts."""
    return (words * (length // len(words) + offset + 2))[offset : offset + length]


def check(name: str, paged: torch.Tensor, dense: torch.Tensor) -> None:
    err = (paged - dense).abs().max().item()
    print(f"  {name:<44} max |paged - dense| = {err:.1e}")
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-4)


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)  # exactly n tokens


def run_alone(prompt_ids: list[int], params: SamplingParams) -> list[int]:
    """The reference: the request by itself, on a scheduler of its own."""
    solo = OnlineScheduler(model, tokenizer, num_kv_blocks=64, max_num_seqs=1)
    rid = solo.add_request(prompt_token_ids=prompt_ids, sampling_params=params)
    for _ in solo.steps():  # step until nothing is left
        pass
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
            if admitted:  # its first chunk starts past whatever the prefix cache (stage 09) already had
                computed = next(chunk.start for chunk in sched.last_chunks if chunk.seq is seq)
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
        assert s.num_prefill_tokens + s.num_decode_tokens <= sched.max_num_batched_tokens, (
            f"step {step} ran {s.num_prefill_tokens + s.num_decode_tokens} tokens, over max_num_batched_tokens: "
            "an admitted chunk takes at most the budget left")
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
section("the policy by hand: a ContinuousBatcher on 8 blocks of 4 tokens, no model")
# What schedule() decides, checked before anything runs on it. advance() stands in for the forward pass: it
# counts a chunk's tokens as computed and registers its full blocks in the prefix cache (stage 09).
policy = ContinuousBatcher(BlockAllocator(num_blocks=8, block_size=4), max_num_seqs=2, max_num_batched_tokens=64)


def admit_by_hand(ids: list[int], max_cached_tokens: int | None = None) -> ScheduledChunk:
    """Admit a sequence of `ids` alone, compute its first chunk, retire it; return that chunk."""
    seq = Sequence("by hand", ids, greedy(1))
    seq.max_cached_tokens = max_cached_tokens  # None, but for stage 15's prompt logprobs
    policy.add(seq)
    chunks = policy.schedule()
    assert [c.seq for c in chunks] == [seq] and seq.status is Status.RUNNING, "admit returns its chunk, RUNNING"
    chunk = chunks[0]
    print(f"  {len(ids)} tokens, max_cached_tokens={max_cached_tokens}: computes {chunk.start}:{chunk.end}")
    assert seq.num_computed_tokens == seq.num_cached_tokens == chunk.start, (
        "admit sets num_computed_tokens (the step computes from there) and num_cached_tokens to the cached tokens")
    assert chunk.end == len(ids), f"the first chunk ends at the prompt's end (the budget allows it): {chunk.end}"
    assert len(seq.block_table) == cdiv(chunk.end, 4), "admit gives the hits and the first chunk's blocks, no more"
    assert len(set(seq.block_table)) == len(seq.block_table), (
        f"block table {seq.block_table} holds a block twice: share the hits before allocating, or allocate may "
        "hand one of them out (evicting what it caches)")
    policy.advance(chunks)
    policy.retire(seq)
    return chunk


ids = list(range(100, 112))  # 12 made-up token ids, 3 blocks
assert admit_by_hand(ids[:8]).start == 0  # nothing cached yet; its 2 full blocks are, after it
again = admit_by_hand(ids[:8])
assert again.start == 4, (
    f"the same 8 tokens again computed {again.start}:{again.end}: a hit never covers the last token, whose "
    "logits sample the first output, so match_prefix reads every token but the last: 1 block of 2 here"
)
capped = admit_by_hand(ids, max_cached_tokens=6)
assert capped.start == 4, (
    f"with max_cached_tokens=6 the hit covered {capped.start} tokens: a hit is cut to the whole blocks "
    "within the cap, 6 // 4 = 1 (stage 15 caps it: the prompt tokens it scores need their logits)"
)
uncached = admit_by_hand(ids, max_cached_tokens=0)
assert uncached.start == 0, f"max_cached_tokens=0 allows no hit (0 is a cap, not None): it covered {uncached.start}"
assert admit_by_hand(ids).start == 8  # no cap: the 2 cached blocks, and never the partial third
assert policy.prefix_cache_hit_tokens == 4 + 4 + 8, "every first admission adds its hit to the batcher's count"
# Preemption: two sequences of 4 blocks each take all 8, and a third waits for a seat. The oldest needs a
# fifth block: grow() finds none free and preempts the newest, which frees its blocks and waits first in line.
older, newer, third = (Sequence(name, list(range(base, base + 16)), greedy(2)) for name, base in
                       (("older", 200), ("newer", 300), ("third", 400)))
for seq in (older, newer, third):
    policy.add(seq)
policy.advance(policy.schedule())
assert policy.running == [older, newer] and policy.allocator.num_free_blocks == 0
assert not policy.grow(older, 17)  # a 17th token needs a block that is not there: the newest is preempted
print(f"  after grow(older, 17): running {[s.request_id for s in policy.running]}, "
      f"waiting {[s.request_id for s in policy.waiting]}, {policy.allocator.num_free_blocks} blocks free")
assert newer not in policy.running and list(policy.waiting) == [newer, third], (
    "a preempted sequence leaves running and goes to the front of the queue: it was admitted before the others")
assert newer.status is Status.WAITING and newer.block_table == [] and policy.allocator.num_free_blocks == 4, (
    "a preempted sequence is WAITING and holds no blocks: its 4 are free")
assert newer.num_computed_tokens == 0, "a preempted sequence is recomputed from its first token"
assert newer.num_preemptions == policy.num_preemptions == 1, "count the preemption on the sequence and the batcher"
assert policy.grow(older, 17)  # now there is room
# newer's first 3 blocks are still cached, in the free queue (grow evicted its tail's). Reusing them takes 3 of
# the 3 free blocks, and it needs a 4th: so it waits, though 3 blocks look free.
older.append_token(7)
try:
    chunks = policy.schedule()
except RuntimeError as e:
    raise AssertionError(f"admit took blocks that are not there ({e}): cached hits that sit in the free queue "
                         "use up free blocks too (allocator.num_unreferenced)") from e
assert [c.seq for c in chunks] == [older] and policy.waiting[0] is newer, "with too few blocks, admit returns None"
policy.retire(older)
for seq in (newer, third):
    policy.discard(seq)
policy.check_invariants()
assert policy.allocator.num_free_blocks == 8

# ---------------------------------------------------------------------------------------
section("continuous batching with chunked prefill: max_num_seqs=3, max_num_batched_tokens=32")
sched = OnlineScheduler(model, tokenizer, block_size=16, num_kv_blocks=64, max_num_seqs=3, max_num_batched_tokens=32)
requests = {
    1: [("A", prompt(10, 0), greedy(6)), ("B", prompt(12, 1), greedy(10)), ("C", prompt(70, 2), greedy(4))],
    3: [("D", prompt(8, 3), greedy(5))],  # arrives while A, B, C run: waits for a free slot
    5: [("E", prompt(9, 4), greedy(3))],
}
outs, history = run(sched, requests)
print(f"{len(history)} steps")

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
section("preemption: 3 requests that need 3 blocks each, on a cache of 8 blocks, and a 4th waiting for a seat")
small = OnlineScheduler(model, tokenizer, block_size=16, num_kv_blocks=8, max_num_seqs=3, max_num_batched_tokens=64)
requests = {1: [(name, prompt(20, 5 + i), greedy(20)) for i, name in enumerate("XYZ")],  # 20 + 20 tokens: 3 blocks
            2: [("W", prompt(20, 8), greedy(4))]}  # no seat for it: it waits
outs, history = run(small, requests)
print({name: (o.num_preemptions, o.num_recompute_cached_tokens) for name, o in outs.items()},
      "(preemptions, tokens the recompute found cached)")
assert small.num_preemptions > 0 and sum(o.num_preemptions for o in outs.values()) == small.num_preemptions
# The newest running request is the one preempted: it frees its blocks and waits at the queue's front,
# ahead of W, which has waited longer but was admitted after it: W never starts before Z is recomputed.
assert steps_of(history, "Z", "PREEMPTED") and not steps_of(history, "X", "PREEMPTED")
z_recompute = [s for s in steps_of(history, "Z", "pre") if s > steps_of(history, "Z", "PREEMPTED")[0]][0]
assert steps_of(history, "W", "pre")[0] >= z_recompute, "a preempted request goes back to the queue's front"
# Its 2 full blocks stayed in the prefix cache (stage 09) while it waited: the recompute found them, 32 tokens
# of its 20-token prompt and its first outputs. Its usage's cached prompt tokens stay those of its first admission.
assert outs["Z"].num_recompute_cached_tokens == 32 and outs["Z"].num_cached_tokens == 0
for name, ids, params in (r for rs in requests.values() for r in rs):
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
# ---------------------------------------------------------------------------------------
section("under the scheduler: the ModelRunner turns one step's chunks into one forward pass")
# The runner by itself, fed chunks by hand as _schedule would: check its metadata and the logits.
BLOCK_SIZE = 16
NUM_BLOCKS = 4 * cdiv(model.config.n_positions, BLOCK_SIZE)
alloc = BlockAllocator(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
order = alloc.allocate(NUM_BLOCKS)
random.Random(1).shuffle(order)
alloc.free(order)  # the free queue is now in shuffled order, so block tables come out scattered
kv = KVCache(model.config, NUM_BLOCKS, BLOCK_SIZE, model.device, model.dtype)
runner = ModelRunner(model, kv, BLOCK_SIZE, TorchBackend(model.device, model.dtype))  # the plain backend (stage 08)
novel = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity."
)
novel_ids = tokenizer.encode(novel)


def make_seq(name: str, length: int) -> Sequence:
    """A sequence of exactly `length` prompt tokens, holding enough blocks for all of them."""
    ids = (novel_ids * (length // len(novel_ids) + 1))[:length]
    seq = Sequence(name, ids, SamplingParams(temperature=0))
    seq.block_table = alloc.allocate(cdiv(length, BLOCK_SIZE))
    return seq


@torch.inference_mode()
def run(chunks: list[ScheduledChunk], show: bool = False) -> torch.Tensor:
    """One engine step without sampling: logits (N, V) of every row, not just the sampling ones."""
    rows = runner.prepare(chunks)  # the flat rows, and the step's layout for attention
    input_ids, batch = rows.input_ids, runner.batch(rows)  # batch: positions, the cache, attention's metadata
    meta = batch.attention
    if show:
        print(f"  rows: {len(input_ids)}, positions {batch.positions.tolist()}")
        print(f"  slot_mapping {meta.slot_mapping.tolist()}")
        prefills = [(c.start, c.end, None if c.context_slots is None else len(c.context_slots)) for c in meta.prefills]
        print(f"  prefill chunks: {prefills}  (first row, end row, context length)")
        print(f"  decode groups: {[tuple(g.slots.shape) for g in meta.decode_groups]}  (sequences, padded length)")
    batch.sample_rows = torch.arange(len(input_ids))  # every row; the engine keeps only the sampling ones
    return model(input_ids, batch)  # (N, V): input_ids (N,), every scheduled token side by side


@torch.inference_mode()
def reference(seq: Sequence) -> torch.Tensor:
    return model(torch.tensor([seq.token_ids]))[0]  # (T, V): stage 01's plain forward, no cache


P, CHUNK = 45, 11  # chunks that straddle block boundaries on purpose
seq = make_seq("prompt", P)
print(f"a {P}-token prompt in chunks of {CHUNK}; block table {seq.block_table}")
logits = []
for start in range(0, P, CHUNK):
    n = min(CHUNK, P - start)
    logits.append(run([ScheduledChunk(seq, start, n)], show=start == CHUNK))
check(f"logits of all {P} positions vs GPT2.forward", torch.cat(logits), reference(seq))

print("one step with four sequences: two decodes of very different lengths, a fresh prompt, a continued one")
x, y, z, w = make_seq("x", 70), make_seq("y", 20), make_seq("z", 9), make_seq("w", 30)
run([ScheduledChunk(x, 0, 69), ScheduledChunk(y, 0, 19), ScheduledChunk(w, 0, 12)])  # earlier steps
chunks = [ScheduledChunk(x, 69, 1), ScheduledChunk(y, 19, 1), ScheduledChunk(z, 0, 9), ScheduledChunk(w, 12, 18)]
mixed = run(chunks, show=True)
batch = runner.batch(runner.prepare(chunks))
meta, sample_rows = batch.attention, batch.sample_rows
# Decodes of 70 and 20 tokens are not padded into one (2, 70) grid: that would be 55% padding.
assert group_by_length([70, 20]) == [[0], [1]] and len(meta.decode_groups) == 2
assert [c.context_slots is None for c in meta.prefills] == [True, False]  # z is fresh, w reads the cache
print(f"  sampling rows (the last row of each chunk): {sample_rows.tolist()}")
for s, row in zip((x, y, z, w), sample_rows.tolist()):
    check(f"next-token logits of {s.request_id} ({s.num_tokens} tokens)", mixed[row], reference(s)[-1])
for s in (seq, x, y, z, w):
    alloc.free(s.block_table)
alloc.check_invariants([])

graded.graded()
print(
    "\nOK: requests join and leave every step, prompts are chunked, preemption recomputes, "
    "outputs never change, every block comes back, and the runner's paged forward equals the plain one."
)
