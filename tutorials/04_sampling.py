"""Stage 04: from logits to a token: greedy, temperature, top-k, top-p, and seeds.

Uses minfer.sampling (SamplingParams, sample, apply_top_k_top_p, make_generator)
on a five-token example small enough to check by hand, and on the model's real
next-token logits; then shows that a seeded request draws the same tokens
whatever else shares its batch, in the sampler and in the engine.

    python tutorials/04_sampling.py              # MINFER_MODEL=/path to choose the checkpoint
"""

import torch
from _common import model_path, section

from minfer import LLM, SamplingParams
from minfer.engine.sampling import make_generator, sample
from minfer.engine.top_k_top_p import apply_top_k_top_p

torch.manual_seed(0)  # the shared RNG, used by rows without a seed
path = model_path()
llm = LLM(path, num_kv_blocks=64, max_num_seqs=8)
model, tokenizer = llm.model, llm.tokenizer
prompt = tokenizer.encode("Once upon a time, there was a little girl named")
with torch.inference_mode():
    model_logits = model(torch.tensor([prompt]))[0, -1]  # (V,) next-token scores after the prompt
V = model_logits.shape[0]

probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04])  # a toy next-token distribution over 5 tokens
toy = probs.log()  # (5,) logits: softmax(log p) = p


def kept(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> list[int]:
    """Token ids that survive apply_top_k_top_p (the rest are set to -inf)."""
    out = apply_top_k_top_p(logits[None], torch.tensor([top_k]), torch.tensor([top_p]))[0]  # (V,)
    return torch.isfinite(out).nonzero().flatten().tolist()


def draw(logits: torch.Tensor, params: SamplingParams, n: int) -> torch.Tensor:
    """n independent draws from one row of logits: the row repeated n times, sampled as one batch."""
    return sample(logits.expand(n, -1), [params] * n, [None] * n)  # (n,)


section("greedy: temperature 0 is argmax, even next to sampled rows")
rows = torch.stack([model_logits, model_logits.roll(1)])  # (2, V): two different rows
params = [SamplingParams(temperature=0), SamplingParams(temperature=0, seed=1)]
for _ in range(3):
    assert torch.equal(sample(rows, params, [None, make_generator(1, "cpu")]), rows.argmax(-1))
mixed = [SamplingParams(temperature=0), SamplingParams(temperature=1.0)]
assert sample(rows, mixed, [None, None])[0].item() == model_logits.argmax().item()
print(
    f"argmax of the model's logits: token {model_logits.argmax().item()} "
    f"{tokenizer.decode([model_logits.argmax().item()])!r}, every time, whatever the other rows do"
)

section("sampling draws each token with its probability (inverse CDF)")
n = 20_000
counts = torch.bincount(draw(toy, SamplingParams(temperature=1.0), n), minlength=5) / n
print(f"p    = {[round(x, 3) for x in probs.tolist()]}")
print(f"seen = {[round(x, 3) for x in counts.tolist()]} in {n:,} draws")
assert (counts - probs).abs().max() < 0.02

section("temperature: divide the logits by T before the softmax")


def entropy(logits: torch.Tensor) -> float:
    p = logits.float().softmax(-1)
    return -(p * p.clamp_min(1e-30).log()).sum().item()  # in nats; log(V) is the uniform maximum


for name, logits in [("toy", toy), ("model", model_logits)]:
    entropies = [entropy(logits / T) for T in (0.25, 0.5, 1.0, 2.0)]
    print(
        f"{name:>5}: entropy at T=0.25, 0.5, 1, 2: "
        + ", ".join(f"{h:.3f}" for h in entropies)
        + f" nats (uniform: {torch.tensor(float(logits.shape[0])).log():.3f})"
    )
    assert all(a < b for a, b in zip(entropies, entropies[1:])), "higher T, flatter distribution"
for T in (0.5, 2.0):
    seen = torch.bincount(draw(toy, SamplingParams(temperature=T), n), minlength=5) / n
    print(f"T={T}: token frequencies {[round(x, 3) for x in seen.tolist()]}")

section("top-k and top-p: sample only from the head of the distribution")
checks = [  # (top_k, top_p, tokens that must survive), on p = [0.5, 0.3, 0.1, 0.06, 0.04]
    (2, 1.0, [0, 1]),  # the 2 most likely
    (0, 0.5, [0]),  # the smallest head with mass >= 0.5: token 0 alone
    (0, 0.8, [0, 1]),  # 0.5 + 0.3 reaches 0.8 exactly (float rounding tolerated)
    (0, 0.85, [0, 1, 2]),  # needs token 2 to pass 0.85
    (3, 0.95, [0, 1, 2]),  # top-k first, then top-p within what is left
    (1, 1.0, [0]),  # top_k=1 is greedy
]
for k, p, expected in checks:
    got = kept(toy, k, p)
    print(f"top_k={k} top_p={p}: keeps {got}")
    assert got == expected
only = draw(toy, SamplingParams(top_k=2), n)
share = (only == 0).float().mean().item()
print(
    f"top_k=2 draws: tokens {sorted(set(only.tolist()))}, token 0 in {share:.3f} of them "
    f"(renormalised: 0.5 / 0.8 = 0.625)"
)
assert set(only.tolist()) <= {0, 1} and abs(share - 0.625) < 0.02
nucleus = len(kept(model_logits, 0, 0.9))
print(
    f"the model's top_p=0.9 nucleus after this prompt: {nucleus} of {V} tokens "
    f"(a trained model is peaked; a random one is nearly flat)"
)
assert 1 <= nucleus <= V

section("seeds: the same tokens whatever the batch neighbours")
seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
g = make_generator(seeded.seed, "cpu")  # the request's own RNG, kept for its whole life
alone = [sample(model_logits[None], [seeded], [g]).item() for _ in range(10)]
crowd = torch.stack([model_logits.roll(7), model_logits, model_logits.flip(0)])  # (3, V): ours in the middle
crowd_params = [SamplingParams(temperature=0.7), seeded, SamplingParams(top_k=5, seed=99)]
gens = [None, make_generator(seeded.seed, "cpu"), make_generator(99, "cpu")]
in_batch = [sample(crowd, crowd_params, gens)[1].item() for _ in range(10)]
print(f"seed 1234 alone:     {alone}")
print(f"seed 1234 in a batch: {in_batch}")
assert alone == in_batch
toy_runs = {}
for s in (1, 2):
    g = make_generator(s, "cpu")
    toy_runs[s] = [sample(toy[None], [SamplingParams(seed=s)], [g]).item() for _ in range(20)]
print(f"toy, seed 1: {toy_runs[1]}\ntoy, seed 2: {toy_runs[2]}")
assert toy_runs[1] != toy_runs[2], "different seeds, different draws"

# The engine keeps one generator per seeded request (Sequence.generator), so the same holds end to end.
request = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
solo = llm.generate([prompt], request, use_tqdm=False)[0].token_ids
others = [tokenizer.encode(t) for t in ("Hello", "A much longer prompt about something else entirely", "1 2 3")]
batch = llm.generate(
    others + [prompt], [SamplingParams(max_tokens=12, temperature=1.3)] * 3 + [request], use_tqdm=False
)
print(f"engine, seed 7 alone:           {solo}\nengine, seed 7 with 3 neighbours: {batch[-1].token_ids}")
assert batch[-1].token_ids == solo

section("parameters are checked when they are made")
try:
    SamplingParams(top_p=0)
except ValueError as e:
    print(f"SamplingParams(top_p=0): ValueError: {e}")
else:
    raise AssertionError("top_p=0 would keep no token")
print("\nOK: greedy is argmax, T changes entropy, top-k/top-p keep what they should, seeds reproduce.")
