"""Stage 06: static batching, and what its padding costs.

Batching requests makes one forward pass serve many sequences, but a plain
(B, T) batch is a rectangle: short prompts are padded to the longest, and the
batch runs until its longest request is done, computing rows for requests that
finished long ago. This script writes that padded loop with the model's own
modules (left padding, an attention mask, a KV cache per layer), checks it
against each request run alone, counts the wasted positions, and runs the same
requests through minfer's engine, which computes no padding at all.

    python tutorials/06_static_batching.py       # MINFER_MODEL=/path to choose the checkpoint
"""

import torch
import torch.nn.functional as F
from _common import model_path, section
from _timing import interleaved, show

from minfer import LLM, SamplingParams

path = model_path()
llm = LLM(path, num_kv_blocks=64, max_num_seqs=8, enable_prefix_caching=False)
model, tokenizer = llm.model, llm.tokenizer
PAD = 0  # any id: padded positions are masked out, their value never matters

# Four requests of mixed prompt lengths and mixed output lengths, as a server would see them.
text = (
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity. "
) * 8
words = tokenizer.encode(text)
prompt_lens, max_new = [6, 18, 40, 64], [4, 32, 8, 16]
prompts = [words[3 * i : 3 * i + n] for i, n in enumerate(prompt_lens)]
B = len(prompts)


def attend(attn, x: torch.Tensor, past, mask: torch.Tensor):
    """Attention layer on x (B, T, C) with a boolean mask (B, 1, T, keys); returns output and new (K, V)."""
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)  # 3 x (B, T, C)
    q, k, v = (t.view(B, T, attn.n_head, attn.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hd)
    if past is not None:
        k, v = torch.cat([past[0], k], dim=2), torch.cat([past[1], v], dim=2)  # (B, nh, keys, hd)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scale)  # (B, nh, T, hd)
    return attn.c_proj(y.transpose(1, 2).reshape(B, T, C)), (k, v)


@torch.inference_mode()
def forward(ids, pos, mask, cache):
    """ids, pos (B, T); mask (B, 1, T, keys) -> last-column logits (B, V); extends the per-layer cache."""
    x = model.wte(ids) + model.wpe(pos)  # (B, T, C)
    for i, block in enumerate(model.h):
        a, cache[i] = attend(block.attn, block.ln_1(x), cache[i], mask)
        x = x + a
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x[:, -1]))  # (B, V)


def static_batch(prompts, max_new):
    """Greedy decoding of a padded batch, run until its longest request is done.
    Returns each request's tokens and the number of positions computed."""
    B, L = len(prompts), max(map(len, prompts))
    ids = torch.full((B, L), PAD)  # (B, L)
    real = torch.zeros(B, L, dtype=torch.bool)  # (B, L) True on real tokens
    for b, p in enumerate(prompts):  # left padding: every prompt ends in the last column,
        ids[b, L - len(p) :] = torch.tensor(p)  # so new tokens go in one new column for all rows
        real[b, L - len(p) :] = True
    pos = (real.cumsum(1) - 1).clamp_min(0)  # (B, L): each prompt's positions start at 0 after its padding
    causal = torch.ones(L, L, dtype=torch.bool).tril()  # (L, L)
    mask = causal & real[:, None, :]  # (B, L, L): the past, minus padding
    mask |= torch.eye(L, dtype=torch.bool)  # a padding row attends to itself (no all-masked row, no NaN)
    cache = [None] * model.config.n_layer
    logits = forward(ids, pos, mask[:, None], cache)  # prefill: (B, V)
    computed = B * L
    steps = max(max_new)  # the batch lives as long as its longest request
    out = [[] for _ in range(B)]
    for step in range(steps):
        next_ids = logits.argmax(-1)  # (B,)
        for b, token in enumerate(next_ids.tolist()):
            if step < max_new[b]:  # a finished request's row is computed, and its token thrown away
                out[b].append(token)
        if step == steps - 1:
            break
        real = torch.cat([real, torch.ones(B, 1, dtype=torch.bool)], dim=1)  # (B, keys): the new column
        pos = pos[:, -1:] + 1  # (B, 1)
        # Finished rows still run: a rectangle has no way to drop a row.
        logits = forward(next_ids[:, None], pos, real[:, None, None, :], cache)
        computed += B
    return out, computed


@torch.inference_mode()
def alone(prompt, n):
    """One request on its own, no padding, no cache: the reference."""
    seq = torch.tensor([prompt])  # (1, T)
    for _ in range(n):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    return seq[0, len(prompt) :].tolist()


section(f"{B} requests: prompt lengths {prompt_lens}, output lengths {max_new}")
static_tokens, computed = static_batch(prompts, max_new)
for b in range(B):
    assert static_tokens[b] == alone(prompts[b], max_new[b]), f"request {b}: padding changed the result"
print("padded batch: every request gets exactly the tokens it gets alone (the mask and positions are right)")

section("where the static batch's work goes")
L, steps = max(prompt_lens), max(max_new)
useful = sum(prompt_lens) + sum(n - 1 for n in max_new)  # each prompt once, then one position per new token
prompt_padding = B * L - sum(prompt_lens)
after_finish = sum(steps - n for n in max_new)  # decode rows of requests that were already done
assert computed == B * L + B * (steps - 1) == useful + prompt_padding + after_finish
waste = 1 - useful / computed
print(f"positions computed:          {computed}")
print(f"  needed:                    {useful}")
print(f"  prompt padding:            {prompt_padding}")
print(f"  rows of finished requests: {after_finish}  (waiting for the longest, {steps} steps)")
print(f"wasted: {waste:.0%} of the work")
assert prompt_padding == 128 and after_finish == 68 and waste > 0.5
for b in range(B):
    print(f"  request {b}: done after {max_new[b]:2} steps, returned after {steps}")

section("the same requests through minfer's engine (continuous batching, stage 10)")
# One flattened forward per step over exactly the tokens that need computing (stages 07-10):
# no padding, and a request leaves the batch the step it finishes.
sched = llm.scheduler
params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in max_new]


def run_engine() -> tuple[list[str], int, dict[str, int]]:
    """The four requests to the end: their ids, the positions computed, and the step each finished."""
    ids = [sched.add_request(prompt_token_ids=p, sampling_params=sp) for p, sp in zip(prompts, params)]
    computed, finished_at, step = 0, {}, 0
    while sched.has_unfinished():
        sched.step()
        step += 1
        computed += sched.last_step.num_prefill_tokens + sched.last_step.num_decode_tokens
        for rid in sched.pop_finished_ids():
            finished_at[rid] = step
    return ids, computed, finished_at


ids, engine_computed, finished_at = run_engine()
outputs = [sched.pop_response(rid) for rid in ids]
for b, o in enumerate(outputs):
    assert o.token_ids == static_tokens[b], f"request {b}: engine {o.token_ids} != static {static_tokens[b]}"
assert engine_computed == useful, "the engine computes exactly the needed positions"
assert [finished_at[rid] for rid in ids] == max_new, "each request returns the step it is done"
print(f"same tokens; positions computed: {engine_computed} (static batch: {computed})")
for b, rid in enumerate(ids):
    print(f"  request {b}: returned after {finished_at[rid]:2} steps")


def engine_again() -> None:
    for rid in run_engine()[0]:
        sched.pop_response(rid)


print("the time of each, in turns (printed, never asserted: on a model this small a step's Python dominates):")
show(interleaved({"static batch": lambda: static_batch(prompts, max_new), "the engine": engine_again}, rounds=5),
     width=14)
print(
    "\nOK: padded static batching is correct but wastes "
    f"{waste:.0%} of its work here; the engine wastes none and returns requests as they finish."
)
