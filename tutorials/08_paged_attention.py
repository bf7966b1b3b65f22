"""Stage 08: paged attention: attention that reads keys and values through block tables.

Calls minfer.attention.paged.paged_attention by hand, on a small cache whose blocks are handed out
in shuffled order, for every kind of row the engine schedules: fresh prompts, single-token decodes
(batched, padded, masked, the padding pointed at the null block) and a prompt continued in a later
chunk. Each output is compared with F.scaled_dot_product_attention over the same keys and values laid
out contiguously. Then the attention backend builds the same metadata from a plain description of
the step (a StepLayout), the way the engine does it, and last the whole engine generates on this
attention and must match the model run without any cache.

How the CPU reads the context faster (a tile at a time, or compiled to read in place) is the
optional stage 08b. Who describes a real step (ModelRunner) comes in stage 10.

    python tutorials/08_paged_attention.py   # MINFER_MODEL=/path to choose the checkpoint
    python tutorials/08_paged_attention.py --exercise   # with your forward (tutorials/exercises/)
"""

import math
import random

import torch
import torch.nn.functional as F
from _common import exercise, model_path, section

from minfer import LLM, SamplingParams
from minfer.attention.backend import StepLayout
from minfer.attention.kv_cache import cdiv, slot_of
from minfer.attention.paged import paged_attention
from minfer.attention.torch_sdpa import DecodeGroup, GatheredMetadata, PrefillChunk, TorchBackend
from minfer.models.gpt2 import GPT2

graded = exercise("08")  # --exercise: your TorchBackend.forward runs instead of minfer's
torch.manual_seed(0)
path = model_path()
model = GPT2.from_pretrained(path)
cfg = model.config
H, D = cfg.n_head, cfg.head_dim
scale = 1 / math.sqrt(D)
# The plain backend: gather each sequence's context, then sdpa (any device). The engine picks a
# backend per model and device (stage 08b shows the CPU's faster ones); they all build and read the
# metadata below.
backend = TorchBackend("cpu", torch.float32)
print(f"attention backend: {backend.name}")


def check(name: str, paged: torch.Tensor, dense: torch.Tensor) -> None:
    err = (paged - dense).abs().max().item()
    print(f"  {name:<44} max |paged - dense| = {err:.1e}")
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-4, msg=f"{name}: paged differs from dense by {err:.1e}")


# ---------------------------------------------------------------------------------------
section("paged_attention by hand, on a cache with shuffled blocks")
BLOCK_SIZE, NUM_BLOCKS = 4, 16
# (num_slots, 2, H, D): one layer's keys and values, each slot's key next to its value (one row per
# slot, so one gather reads both). The engine allocates it with torch.empty, whose memory may hold
# anything, NaN included; NaN here makes any read of a never-written slot show up.
kv_cache = torch.full(((NUM_BLOCKS + 1) * BLOCK_SIZE, 2, H, D), float("nan"))
NULL = NUM_BLOCKS  # the extra block no sequence owns, kept zeroed: padding reads it
kv_cache[NULL * BLOCK_SIZE :] = 0
ids = list(range(NUM_BLOCKS))
random.Random(0).shuffle(ids)  # a cache that has served for a while hands out blocks in no order
tables = {"A": ids[0:4], "B": ids[4:6]}  # A gets up to 16 tokens, B up to 8
LEN = {"A": 16, "B": 7}
print(f"block tables: {tables}")

# Every token's query, key and value, as the layer's c_attn would produce them.
q = {s: torch.randn(n, H, D) for s, n in LEN.items()}  # (L, H, D) per sequence
k = {s: torch.randn(n, H, D) for s, n in LEN.items()}
v = {s: torch.randn(n, H, D) for s, n in LEN.items()}


def dense(s: str) -> torch.Tensor:
    """The reference: causal attention over the sequence's contiguous K/V. Returns (L, H, D)."""
    qs, ks, vs = (t[s].transpose(0, 1) for t in (q, k, v))  # (H, L, D)
    return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale).transpose(0, 1)


def slots(s: str, positions) -> torch.Tensor:
    table = tables[s]
    return torch.tensor([slot_of(table, p, BLOCK_SIZE) for p in positions])  # (len(positions),)


def step(rows: list[tuple[str, int, int]], meta: GatheredMetadata) -> torch.Tensor:
    """Flatten rows [(seq, start, end)] into (N, H, D) and run paged_attention on them."""
    pick = lambda t: torch.cat([t[s][a:b] for s, a, b in rows])  # noqa: E731  (N, H, D)
    meta.slot_mapping = torch.cat([slots(s, range(a, b)) for s, a, b in rows])  # (N,)
    return paged_attention(pick(q), pick(k), pick(v), kv_cache, meta, scale)  # (N, H, D)


print("step 1: two fresh prompts, A[0:10] and B[0:5], flattened into 15 rows")
meta = GatheredMetadata(None, backend, prefills=[PrefillChunk(0, 10, None, None), PrefillChunk(10, 15, None, None)])
out = step([("A", 0, 10), ("B", 0, 5)], meta)
check("A prefill (its own keys, causal)", out[0:10], dense("A")[0:10])
check("B prefill", out[10:15], dense("B")[0:5])
assert torch.equal(kv_cache[slots("A", range(10)), 0], k["A"][:10]), "keys were stored in A's slots"

print("step 2: one decode each, A position 10 and B position 5, batched in one group")
lens = [11, 6]  # context lengths, the new token included
L = max(lens)
padded = [t + [NULL] * (cdiv(L, BLOCK_SIZE) - len(t)) for t in (tables["A"][: cdiv(11, BLOCK_SIZE)], tables["B"])]
table_t = torch.tensor(padded)  # (S, max_blocks): short tables padded with the null block
pos = torch.arange(L)  # (L,)
grid = slot_of(table_t, pos, BLOCK_SIZE)  # (S, L): slot of every context position
valid = pos[None, :] < torch.tensor(lens)[:, None]  # (S, L): False on padding
mask = valid[:, None, None, :]  # (S, 1, 1, L), the shape sdpa broadcasts over heads and the query
# B's positions 6 and 7 fall in B's own last block, in slots nothing has written yet. The mask hides
# them, but a masked NaN still poisons the weighted sum (weight 0 * NaN = NaN): see for yourself.
meta = GatheredMetadata(None, backend, decode_groups=[DecodeGroup(torch.tensor([0, 1]), grid, mask)])
assert step([("A", 10, 11), ("B", 5, 6)], meta)[1].isnan().all(), "unwritten slots leak through the mask"
print("  padding that reads B's own unwritten slots gives NaN, masked or not; so padding reads the null block:")
grid = torch.where(valid, grid, NULL * BLOCK_SIZE)  # every padded position -> a zeroed slot
print(f"  slots (S, L) =\n{grid}")
meta.decode_groups = [DecodeGroup(torch.tensor([0, 1]), grid, mask)]
out = step([("A", 10, 11), ("B", 5, 6)], meta)  # the same step again: it rewrites the same keys
check("A decode (one query, 11 keys)", out[0], dense("A")[10])
check("B decode (one query, 6 keys + 5 padding)", out[1], dense("B")[5])

print("step 3: a mixed step: B decodes position 6 while A's prompt continues with positions 11..15")
ctx = torch.arange(16)  # (16,) A's context: positions 0..15
query_pos = torch.arange(11, 16)  # (5,)
chunk = PrefillChunk(1, 6, context_slots=slots("A", range(16)), mask=ctx[None, :] <= query_pos[:, None])
b_grid = slots("B", range(7))[None, :]  # (1, 7), nothing padded: no mask
meta = GatheredMetadata(None, backend, decode_groups=[DecodeGroup(torch.tensor([0]), b_grid, None)], prefills=[chunk])
out = step([("B", 6, 7), ("A", 11, 16)], meta)
check("B decode", out[0], dense("B")[6])
check("A chunk (5 queries over 16 cached keys)", out[1:6], dense("A")[11:16])

print("step 3 again, the engine's way: describe the step, and the backend builds the metadata")
layout = StepLayout(  # what ModelRunner.prepare hands the backend each step: per sequence, in row order
    slot_mapping=torch.cat([slots("B", [6]), slots("A", range(11, 16))]),  # (6,) where the new keys go
    query_starts=[0, 1],  # B's row, then A's five
    query_lens=[1, 5],
    context_lens=[7, 16],  # each sequence's length once the step is done
    block_tables=[tables["B"], tables["A"]],
    block_size=BLOCK_SIZE,
    null_block=NULL,
)
built = backend.build_metadata(layout)
assert torch.equal(built.decode_groups[0].slots, b_grid) and torch.equal(built.prefills[0].mask, chunk.mask)
assert torch.equal(built.prefills[0].context_slots, chunk.context_slots)
check("the same step from the built metadata", step([("B", 6, 7), ("A", 11, 16)], built), out)

print("step 4: grouped-query attention (stage 14's models): 4 query heads share 2 key/value heads, in pairs")
gq, gk, gv = torch.randn(10, 4, D), torch.randn(10, 2, D), torch.randn(10, 2, D)  # one 10-token sequence, G
gqa_cache = torch.zeros(((NUM_BLOCKS + 1) * BLOCK_SIZE, 2, 2, D))  # (num_slots, 2, Hkv, D)
g_table = ids[6:9]
# Query heads 0 and 1 read key/value head 0, heads 2 and 3 read head 1: the reference repeats each K/V head.
g_dense = F.scaled_dot_product_attention(gq.transpose(0, 1), gk.repeat_interleave(2, 1).transpose(0, 1),
                                         gv.repeat_interleave(2, 1).transpose(0, 1), is_causal=True, scale=scale)
for a, b in ((0, 6), (6, 9), (9, 10)):  # a fresh prompt, a chunk after it, a decode
    g_layout = StepLayout(torch.tensor([slot_of(g_table, p, BLOCK_SIZE) for p in range(a, b)]), query_starts=[0],
                          query_lens=[b - a], context_lens=[b], block_tables=[g_table], block_size=BLOCK_SIZE,
                          null_block=NULL)
    g_out = paged_attention(gq[a:b], gk[a:b], gv[a:b], gqa_cache, backend.build_metadata(g_layout), scale)
    check(f"G rows {a}:{b} (4 query heads, 2 K/V heads)", g_out, g_dense.transpose(0, 1)[a:b])


# ---------------------------------------------------------------------------------------
section("the whole engine on this attention")
# Every layer of every step of LLM.generate calls paged_attention, and so the backend's forward. The
# plain backend runs narrow caches on a CPU ("eager" picks it; wider caches take its tiled version,
# stage 08b, with the same forward). Greedy tokens must be those of the model without any cache.
llm = LLM(path, attention_backend="eager", dtype="float32", num_kv_blocks=32, max_num_seqs=4)
assert isinstance(llm.scheduler.attention, TorchBackend), llm.scheduler.attention
prompts = [llm.tokenizer.encode(text) for text in ("The cat sat on the", "Once upon a time, there was a little")]
NEW = 12
outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True), use_tqdm=False)
with torch.inference_mode():
    for prompt, out in zip(prompts, outs):
        seq = torch.tensor([prompt])  # (1, T): stage 03's loop without a cache, the reference
        for _ in range(NEW):
            seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
        assert out.token_ids == seq[0, len(prompt) :].tolist(), "the paged engine must match the plain model"
print(f"LLM.generate, {len(prompts)} prompts batched, paged: the same {NEW} greedy tokens each as the model "
      "without a cache")
assert llm.stats()["num_kv_blocks_free"] == 32

graded.graded()
print("\nOK: paged attention equals dense attention, for prefills, padded decodes and continued chunks.")
