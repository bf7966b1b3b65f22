"""Stage 16: parallel sampling: n completions of one prompt on shared KV blocks.

Part 1 runs one request with n = 4 through the engine's OnlineScheduler a step at a time and prints
the block tables: the prompt is prefilled once, the four choices then hold the same full blocks (one
reference each), and each choice but the first gets its own copy of the partial last block.
Each choice draws exactly what a request with its own seed (seed + index) draws alone.

Part 2 serves n = 4 in a cache too small for four copies of the prompt: all four run at once, without
a preemption. Four separate requests (prefix caching off) hold a copy of the prompt each: only two fit,
and the other two wait to be admitted (admission checks the blocks first, so none is preempted), which
takes twice the steps.

    python tutorials/16_parallel_sampling.py   # MINFER_MODEL=/path to choose the checkpoint
"""

from _common import model_path, section

from minfer import LLM, SamplingParams

path = model_path()
llm = LLM(path, num_kv_blocks=64, max_num_seqs=8)
sched, allocator = llm.scheduler, llm.scheduler.allocator
BLOCK_SIZE = sched.block_size
words = llm.tokenizer.encode("Once upon a time there was a little fox who lived in the woods. ")
prompt = (words * 60)[: 3 * BLOCK_SIZE + 5]  # 3 full blocks and 5 tokens, on any tokenizer
N, NEW = 4, 8
params = SamplingParams(max_tokens=NEW, temperature=1.0, seed=42, n=N, ignore_eos=True)

# ---------------------------------------------------------------------------------------
section(f"part 1: one prompt of {len(prompt)} tokens, n = {N}")
rid = sched.add_request(prompt_token_ids=prompt, sampling_params=params)
held = sched.features.forks.held[sched.waiting[0]]
print(f"queued: one sequence runs the prompt; {len(held)} forks wait for its prefill")
while len(sched.running) < N:  # the prefill step samples N tokens from the prompt's last row
    sched.step()
tables = [list(seq.block_table) for seq in sched.running]
for seq, table in zip(sched.running, tables):
    print(f"  choice {seq.index}: block table {table}")
refs = [allocator.blocks[b].ref_count for b in tables[0]]
print(f"reference counts {refs}; blocks used {allocator.num_blocks - allocator.num_free_blocks}, "
      f"shared {sched.stats()['num_kv_blocks_shared']}")
assert all(t[:3] == tables[0][:3] for t in tables) and refs == [N] * 3 + [1]  # one copy of the full blocks
partial = tables[0][3]  # holds 5 of the prompt's tokens: each choice's next token goes there
copies = [t[3] for t in tables[1:]]
print(f"the partial block {partial} is choice 0's; choices 1-{N - 1} got copies {copies}")
assert len(set(copies + [partial])) == N  # each writes its own next token: the first in place
assert sched.stats()["num_kv_blocks_shared"] == 3
sched.step()
assert all(seq.block_table[:4] == table[:4] for seq, table in zip(sched.running, tables))
used = allocator.num_blocks - allocator.num_free_blocks
alone = N * len(tables[0])
print(f"blocks used: {used}; four separate copies would hold {alone}: {alone - used} blocks saved")
assert used == 3 + N and alone - used == 3 * (N - 1)

while not sched.is_finished(rid):
    sched.step()
outs = sched.pop_responses(rid)
for out in outs:
    print(f"  choice {out.index}: {out.text!r}")
# The copies hold the prompt's keys and values: each choice is what its seed draws alone.
for out in outs:
    own = SamplingParams(max_tokens=NEW, temperature=1.0, seed=42 + out.index, ignore_eos=True)
    assert out.token_ids == llm.generate([prompt], own, use_tqdm=False)[0].token_ids
assert allocator.num_free_blocks == allocator.num_blocks and sched.stats()["num_kv_blocks_shared"] == 0
print("each choice equals a request with seed 42 + index run alone; every block is free again")

# ---------------------------------------------------------------------------------------
section("part 2: a cache too small for four copies of the prompt")
# Each choice needs 4 blocks (53 + 8 tokens). Four copies need 16; shared, 3 + 4 = 7 fit in 8.
small = LLM(path, num_kv_blocks=8, max_num_seqs=8, enable_prefix_caching=False)


def run(requests: list[tuple[list[int], SamplingParams]]):
    """Run requests together; returns their outputs, the most sequences that ran at once, and the steps."""
    s = small.scheduler
    ids = [s.add_request(prompt_token_ids=p, sampling_params=sp) for p, sp in requests]
    most, steps = 0, s.num_steps
    while s.has_unfinished():
        s.step()
        most = max(most, len(s.running))
    return [o for i in ids for o in s.pop_responses(i)], most, s.num_steps - steps


shared_outs, shared_most, shared_steps = run([(prompt, params)])
separate = [(prompt, SamplingParams(max_tokens=NEW, temperature=1.0, seed=42 + i, ignore_eos=True)) for i in range(N)]
separate_outs, separate_most, separate_steps = run(separate)
print(f"n = {N}: {shared_most} sequences at once, {shared_steps} steps, "
      f"{sum(o.num_preemptions for o in shared_outs)} preemptions")
separate_preemptions = sum(o.num_preemptions for o in separate_outs)
print(f"{N} separate requests: {separate_most} at once (a copy of the prompt each), {separate_steps} steps, "
      f"{separate_preemptions} preemptions")
assert shared_most == N and sum(o.num_preemptions for o in shared_outs) == 0
# Separately, each needs all 4 of its blocks to be admitted (its prompt fits the token budget in one chunk):
# two are admitted, the other two wait for their blocks. Nobody is preempted; the run takes twice the steps.
assert small.scheduler.max_num_batched_tokens >= len(prompt)
assert separate_most == small.scheduler.allocator.num_blocks // 4 == 2 and separate_preemptions == 0
assert separate_steps == 2 * shared_steps
assert [o.token_ids for o in shared_outs] == [o.token_ids for o in separate_outs]  # the same draws, either way
print("the same text either way; sharing the prompt is what lets all four run at once")
