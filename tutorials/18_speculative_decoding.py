"""Stage 18: speculative decoding. Propose a few tokens cheaply, let the model check them all in one
forward pass, keep the ones it agrees with: more than one token per step, with the same output.

It loads the model of the other stages and: times one forward over 1 row and over k + 1 rows of one
sequence (in turns, median and spread, never asserted), with the bytes and FLOPs each must move; checks
on a six-token distribution that the acceptance rule samples exactly the target distribution; runs
the engine with n-gram (prompt lookup) speculation on a text that repeats, beside plain decoding; and
then with a draft model (the model itself, unless a trained draft ships beside it). On minfer-tiny,
which seldom copies, the last two run on minfer-tiny-llama, which does.

    python tutorials/18_speculative_decoding.py   # MINFER_MODEL=/path to choose the checkpoint
"""

from pathlib import Path

import torch
from _common import model_path, section
from _timing import BUSY_MACHINE, claim, interleaved, show

from minfer import LLM, SamplingParams
from minfer.bench.workload import copy_prompt
from minfer.speculative.speculation import VerifyChunk
from minfer.speculative.ngram import NgramProposer
from minfer.speculative.verify import VerifyRows, verify
from minfer.models.loader import BUILTIN_MODELS

torch.manual_seed(0)
path = model_path()

section("1. checking k tokens costs about what generating one does")
llm = LLM(path)
sched = llm.scheduler
config = llm.model.config
params = sum(p.numel() for p in llm.model.parameters())
prompt = torch.randint(0, config.vocab_size - 1, (min(64, config.max_positions // 2),)).tolist()
request = sched.add_request(prompt_token_ids=prompt, sampling_params=SamplingParams(max_tokens=32, temperature=0))
sched.step()  # the prefill, and the first token
seq = sched.running[0]
sched.batcher.grow(seq, seq.num_tokens + 8)  # room for the proposals' keys and values
forwards = {}
for k in (0, 4, 8):
    chunk = VerifyChunk(seq, seq.num_computed_tokens, 1, draft=[7] * k)  # k made-up proposals: k + 1 rows
    forwards[f"{1 + k} row{'s' * (k > 0)}"] = lambda chunk=chunk: sched.runner.execute([chunk])
    print(f"  {1 + k} row(s) read {4 * params / 1e6:.0f} MB of fp32 weights and compute "
          f"{2 * params * (1 + k) / 1e6:.0f} MFLOP")
timings = interleaved(forwards, rounds=7)
show(timings, width=10)
claim(timings, "9 rows", "1 row", "checking 8 proposals costs less than twice generating one token",
      "On a model this small a forward is mostly fixed costs either way, but a busy CPU can stretch any one "
      "round. " + BUSY_MACHINE, factor=2.0)
sched.discard_request(request)
assert sched.allocator.num_free_blocks == sched.allocator.num_blocks

section("2. the acceptance rule keeps the target distribution")
p = torch.tensor([0.30, 0.25, 0.20, 0.15, 0.07, 0.03])  # the target's next-token distribution
R, proposal = 40_000, 0  # R independent verifications of the same proposal: token 0
rows = VerifyRows([SamplingParams(temperature=1.0)] * R, [None] * R, [None] * R, [proposal] * R)
tokens, accepted = verify(p.log().expand(R, -1), rows)  # (R,) each
empirical = torch.bincount(tokens, minlength=len(p)).float() / R
print(f"  accepted {accepted.float().mean():.3f} of proposals (p[0] = {p[0]:.2f})")
print(f"  target    {[round(x, 3) for x in p.tolist()]}")
print(f"  emitted   {[round(x, 3) for x in empirical.tolist()]}")
assert (empirical - p).abs().max() < 0.01  # accept with p(d), else draw from p without d: exactly p

section("3. n-gram proposals on a text that repeats")
ngram = NgramProposer(2, 4)
print("  [5, 6, 7, 8, 9, 6, 7] ->", ngram.propose([5, 6, 7, 8, 9, 6, 7], 3), "(what followed '6 7' before)")
# Lookup pays only if the model repeats what it read. minfer-tiny (GPT-2) hardly does; minfer-tiny-llama,
# the same stories and tokenizer in Llama's shape with a copy warm-up, does. It takes over from here.
if Path(path).resolve() == BUILTIN_MODELS["minfer-tiny"].resolve():
    path = str(BUILTIN_MODELS["minfer-tiny-llama"])
    llm = LLM(path)
    config = llm.model.config
    print(f"  from here on: minfer-tiny-llama, which copies from its context ({path})")
heldout = Path(path) / "heldout.txt"
if heldout.is_file():  # the shipped models: two held-out stories, then the first one's opening again
    stories = [s for s in heldout.read_text(encoding="utf-8").split("<|endoftext|>") if s.strip()]
    text = copy_prompt(stories[0], stories[1])  # the benchmark's copy prompt (bench/workload.py)
    ids = llm.tokenizer.encode_prompt(text)
else:  # a random model copies nothing it read, but its greedy output loops: lookup finds the loop
    ids = prompt + prompt[:8]
ids = ids[-(config.max_positions - 64) :]
greedy = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
spec = LLM(path, speculative_method="ngram", num_speculative_tokens=4)
for name, engine in (("plain", llm), ("ngram", spec)):
    steps = engine.scheduler.num_steps
    out = engine.generate([ids], greedy, use_tqdm=False)[0]
    print(f"  {name:<6} {len(out.token_ids)} tokens in {engine.scheduler.num_steps - steps} steps")
    if name == "plain":
        plain = out
assert out.token_ids == plain.token_ids  # greedy: speculation changes the speed, never the tokens
stats = spec.scheduler.features.speculation.speculator.stats
print(f"  acceptance rate {stats.acceptance_rate:.2f}, mean accepted length {stats.mean_accepted_length:.2f} "
      f"tokens per verification")
timings = interleaved({name: lambda engine=engine: engine.generate([ids], greedy, use_tqdm=False)
                       for name, engine in (("plain", llm), ("ngram", spec))}, rounds=3, warmup=0)
show(timings, width=8)
claim(timings, "ngram", "plain", "n-gram speculation generates the text faster",
      "Fewer steps win only while a step costs about the same with proposals as without; on a busy machine "
      "one slow round can outweigh that. " + BUSY_MACHINE)

section("5. n-gram vs a draft model")
# A draft is a smaller model with the same vocabulary that proposes its own greedy tokens: it guesses
# where nothing repeats, at the cost of k small forwards per step. Its KV cache sits on the model's
# blocks (speculative/draft.py). With no trained draft at hand, the model is its own draft:
# every proposal is accepted, and each step costs k forwards of the full model for k + 1 tokens.
draft = path  # the model itself, unless a trained draft ships beside it
for name in ("minfer-tiny", "minfer-tiny-llama"):
    if Path(path).resolve() == BUILTIN_MODELS[name].resolve():
        draft = str(BUILTIN_MODELS[name + "-draft"])
drafted = LLM(path, speculative_method="draft", speculative_model=str(draft), num_speculative_tokens=4)
engines = {"ngram": LLM(path, speculative_method="ngram"), "draft": drafted}
for name, engine in engines.items():
    out = engine.generate([ids], greedy, use_tqdm=False)[0]
    stats = engine.scheduler.features.speculation.speculator.stats
    print(f"  {name:<6} {engine.scheduler.num_steps - 1} decode steps; acceptance rate "
          f"{stats.acceptance_rate:.2f}, mean accepted length {stats.mean_accepted_length:.2f}")
    assert out.token_ids == plain.token_ids  # either way, plain decoding's tokens
timings = interleaved({name: lambda engine=engine: engine.generate([ids], greedy, use_tqdm=False)
                       for name, engine in engines.items()}, rounds=3, warmup=0)
show(timings, width=8)
claim(timings, "ngram", "draft", "the n-gram proposer is the faster here",
      "A draft's forwards cost a share of the model's each (all of it, when the model is its own draft), "
      "which the n-gram lookup does not pay; how much that weighs depends on this CPU. " + BUSY_MACHINE)
if draft == path:
    # its own draft is always right
    assert drafted.scheduler.features.speculation.speculator.stats.acceptance_rate > 0.99
