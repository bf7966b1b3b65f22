"""Stage 03: the generation loop, first without and then with a KV cache.

Generating one token needs the logits of the last position only, but a plain
forward pass recomputes every position of the sequence, every step: quadratic
work. Keys and values of past positions never change (causal attention), so
we keep them per layer and feed the model one new token per step: linear work.
Both loops are written here with the model's own modules; they must produce the
same tokens. At the end minfer's engine (paged KV cache, later stages) runs the
same request and must agree too.

    python tutorials/03_kv_cache_generation.py   # MINFER_MODEL=/path to choose the checkpoint
    python tutorials/03_kv_cache_generation.py --exercise   # with your attention_with_cache (tutorials/exercises/)
"""

import torch
import torch.nn.functional as F
from _common import exercise, model_path, section
from _timing import BUSY_MACHINE, claim, interleaved, show

from minfer import LLM, SamplingParams
from minfer.attention.kv_cache import cdiv
from minfer.models.gpt2 import GPT2
from minfer.text.tokenizer import Tokenizer

path = model_path()
model = GPT2.from_pretrained(path)
tokenizer = Tokenizer.from_dir(path)
cfg = model.config

prompt = tokenizer.encode(  # a story's start: real GPT-2 and minfer-tiny (which knows only stories) both go on
    "Once upon a time, there was a little girl named Lily. She liked to play outside every day. "
    "One day, Lily went to the park with her mom. She saw a red ball under a tree."
)
NEW_TOKENS = 48
prompt = prompt[: cfg.n_positions // 2]  # prompt and new tokens fit any context from 128 positions up
P = len(prompt)


@torch.inference_mode()
def generate_naive(ids: list[int], n: int) -> tuple[list[int], int]:
    """Greedy decoding by rerunning the whole sequence each step. Returns (tokens, positions computed)."""
    seq = torch.tensor([ids])  # (1, T)
    computed = 0
    for _ in range(n):
        logits = model(seq)  # (1, T, V): every position again, though only the last is used
        computed += seq.shape[1]
        next_id = logits[:, -1].argmax(-1, keepdim=True)  # (1, 1)
        seq = torch.cat([seq, next_id], dim=1)  # (1, T + 1)
    return seq[0, len(ids) :].tolist(), computed


def attention_with_cache(attn, x: torch.Tensor, past: tuple | None):
    """One attention layer over the new positions x (1, T, C), given the cached (K, V) of the past.
    Returns the output (1, T, C) and the cache extended with this step's keys and values."""
    B, T, C = x.shape
    q, k, v = attn.c_attn(x).split(C, dim=2)  # 3 x (1, T, C)
    q, k, v = (t.view(B, T, attn.n_head, attn.head_dim).transpose(1, 2) for t in (q, k, v))  # (1, nh, T, hd)
    if past is not None:
        k = torch.cat([past[0], k], dim=2)  # (1, nh, P + T, hd): the old keys are reused as they are
        v = torch.cat([past[1], v], dim=2)
    # Prefill (no past): causal over the prompt. Decode (one query, the newest position): it may see
    # every key, so no mask. A chunk of T > 1 after a past of P: query i sits at position P + i and may
    # see keys 0..P + i, a causal mask shifted right by P.
    P = k.shape[2] - T
    mask = None if past is None or T == 1 else torch.ones(T, P + T, dtype=torch.bool).tril(diagonal=P)  # (T, P + T)
    y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=past is None, scale=attn.scale)
    return attn.c_proj(y.transpose(1, 2).reshape(B, T, C)), (k, v)  # y (1, nh, T, hd)


@torch.inference_mode()
def forward_with_cache(ids: torch.Tensor, start: int, cache: list) -> torch.Tensor:
    """ids (1, T) at positions start..start+T-1 -> logits of the last one (1, V); updates cache in place."""
    pos = torch.arange(start, start + ids.shape[1])  # (T,) positions continue where the cache ends
    x = model.wte(ids) + model.wpe(pos)  # (1, T, C)
    for i, block in enumerate(model.h):
        a, cache[i] = attention_with_cache(block.attn, block.ln_1(x), cache[i])
        x = x + a
        x = x + block.mlp(block.ln_2(x))
    return model.lm_head(model.ln_f(x[:, -1]))  # (1, V): the LM head only where we sample


graded = exercise("03", globals())  # --exercise: your attention_with_cache (tutorials/exercises/) runs instead


def generate_cached(ids: list[int], n: int) -> tuple[list[int], int, list]:
    """Greedy decoding with a KV cache. Returns (tokens, positions computed, the final cache)."""
    cache = [None] * cfg.n_layer  # per layer: (K, V), each (1, n_head, length, head_dim)
    logits = forward_with_cache(torch.tensor([ids]), 0, cache)  # prefill: the whole prompt once
    computed, out = len(ids), []
    for step in range(n):
        out.append(logits.argmax(-1).item())
        if step == n - 1:
            break  # the last token needs no forward pass: nothing comes after it
        logits = forward_with_cache(torch.tensor([[out[-1]]]), len(ids) + step, cache)  # decode: one token
        computed += 1
    return out, computed, cache


section(f"greedy decoding of {NEW_TOKENS} tokens after a {P}-token prompt")
naive_tokens, naive_work = generate_naive(prompt, NEW_TOKENS)
cached_tokens, cached_work, cache = generate_cached(prompt, NEW_TOKENS)
print(f"without a cache: {naive_work:6,} positions computed")
print(f"with a KV cache: {cached_work:6,} positions computed")
print(f"text: {tokenizer.decode(cached_tokens)!r}")

assert cached_tokens == naive_tokens, "the cache must not change what is generated"
# Rerunning: step s computes P + s positions, a sum that grows with the square of the length.
assert naive_work == sum(P + s for s in range(NEW_TOKENS)) == NEW_TOKENS * P + NEW_TOKENS * (NEW_TOKENS - 1) // 2
# Cached: the prompt once, then one position per new token (but the last).
assert cached_work == P + NEW_TOKENS - 1
print(f"same {NEW_TOKENS} tokens; {naive_work / cached_work:.1f}x fewer positions computed with the cache")
timings = interleaved(
    {"without a cache": lambda: generate_naive(prompt, NEW_TOKENS),
     "with a KV cache": lambda: generate_cached(prompt, NEW_TOKENS)},
    rounds=5,
)
show(timings, width=18)
claim(timings, "with a KV cache", "without a cache", "the cached loop is faster",
      "On a model this small, Python and the per-layer calls cost as much as the positions computed, so "
      "the gap is narrow, and a busy machine can hide it. " + BUSY_MACHINE)

section("a chunk after a past: the prompt prefilled in pieces")
# Chunked prefill (stage 10) feeds a long prompt a few tokens at a time: each chunk attends to the
# cached keys of the chunks before it and, causally, to its own. The result must be the same cache
# and the same next-token logits as the prompt in one go.
whole = [None] * cfg.n_layer
whole_logits = forward_with_cache(torch.tensor([prompt]), 0, whole)
pieces = [None] * cfg.n_layer
CHUNK = max(2, P // 3)  # three or four chunks of several tokens each
for start in range(0, P, CHUNK):
    piece_logits = forward_with_cache(torch.tensor([prompt[start : start + CHUNK]]), start, pieces)
print(f"{P} prompt tokens in chunks of {CHUNK}: last logits differ by at most "
      f"{(piece_logits - whole_logits).abs().max().item():.1e}")
torch.testing.assert_close(piece_logits, whole_logits, atol=1e-4, rtol=1e-4)
for layer in range(cfg.n_layer):  # every layer's keys depend on the attention of the layer below
    torch.testing.assert_close(pieces[layer][0], whole[layer][0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(pieces[layer][1], whole[layer][1], atol=1e-4, rtol=1e-4)
print("the same cache, every layer, and the same next-token logits as the prompt at once")

section("what the cache costs: memory")
k0, v0 = cache[0]
length = P + NEW_TOKENS - 1  # every position that went through the model
assert k0.shape == v0.shape == (1, cfg.n_head, length, cfg.head_dim)
per_token = 2 * cfg.n_layer * cfg.n_embd * k0.element_size()  # K and V, every layer, float32
print(f"per layer K and V are {tuple(k0.shape)} = (batch, heads, positions, head_dim)")
print(
    f"{per_token:,} bytes ({per_token / 1024:g} KiB) per token; a full {cfg.n_positions}-token context: "
    f"{per_token * cfg.n_positions / 2**20:.1f} MiB per sequence"
)

section("minfer's engine does the same with a paged cache")
# LLM keeps K and V in fixed-size blocks of one preallocated tensor instead of a growing
# torch.cat per sequence (stages 07-10); greedy decoding must give the very same tokens.
llm = LLM(path, num_kv_blocks=cdiv(P + NEW_TOKENS, 16), max_num_seqs=1)
out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True), use_tqdm=False)[0]
assert out.token_ids == cached_tokens
print(f"LLM.generate: the same {len(out.token_ids)} tokens")
graded.graded()
print("\nOK: same tokens with and without the cache, quadratic vs linear work, chunks after a past, "
      "and the engine agrees.")
