"""Speculative decoding A/B in one process: plain and n-gram engines side by side, alternating request by
request, so a shared machine's changing load falls on both alike (separate bench.py runs one after the
other caught a rising load on whichever ran second).

    python scripts/spec_ab.py [--model minfer-tiny] [--rounds 3] [--num-threads 1]

Workloads: copy (bench.py --workload copy: held-out stories, then the first one's opening), batch 1;
free (random token prompts), batch 1; and 16 streams of random prompts at once. Prints tokens/s of each
engine per round, the ratio ngram / plain, and the acceptance rate and mean accepted length.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from minfer import LLM, SamplingParams
from minfer.bench.workload import copy_texts, sampleable_token_ids
from minfer.models.loader import resolve_model_dir


def workloads(model_dir, tokenizer, vocab: int, rng: random.Random) -> dict[str, list[list[int]]]:
    ids = sampleable_token_ids(tokenizer, vocab)
    random_prompts = [[rng.choice(ids) for _ in range(64)] for _ in range(32)]
    return {
        "copy, batch 1": [tokenizer.encode_prompt(t) for t in copy_texts(model_dir, 8)],
        "free, batch 1": random_prompts[:8],
        "16 streams": random_prompts[:32],
    }


def run(llm: LLM, prompts: list[list[int]], batch: int, params: SamplingParams) -> tuple[int, float]:
    """Tokens and seconds for the prompts, `batch` at a time."""
    start, tokens = time.perf_counter(), 0
    for i in range(0, len(prompts), batch):
        tokens += sum(len(o.token_ids) for o in llm.generate(prompts[i : i + batch], params, use_tqdm=False))
    return tokens, time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="minfer-tiny")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--output-len", type=int, default=96)
    args = p.parse_args()
    model_dir = resolve_model_dir(args.model)
    common = {"attention_backend": "eager", "num_threads": args.num_threads}
    plain = LLM(str(model_dir), **common)
    spec = LLM(str(model_dir), speculative_method="ngram", **common)
    loads = workloads(model_dir, plain.tokenizer, plain.model.config.vocab_size, random.Random(0))
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for name, prompts in loads.items():
        batch = 16 if name == "16 streams" else 1
        run(plain, prompts[:1], 1, params), run(spec, prompts[:1], 1, params)  # warm-up
        stats = spec.scheduler.speculator.stats
        drafts0, proposed0, accepted0 = stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens
        ratios = []
        for r in range(args.rounds):
            rates = {"plain": [0, 0.0], "ngram": [0, 0.0]}
            for i in range(0, len(prompts), batch):  # alternate, a batch at a time
                for label, llm in (("plain", plain), ("ngram", spec)) if i % 2 == 0 else (("ngram", spec), ("plain", plain)):
                    tokens, seconds = run(llm, prompts[i : i + batch], batch, params)
                    rates[label][0] += tokens
                    rates[label][1] += seconds
            tps = {k: t / s for k, (t, s) in rates.items()}
            ratios.append(tps["ngram"] / tps["plain"])
            print(f"{name:<14} round {r + 1}: plain {tps['plain']:7.1f} tok/s, ngram {tps['ngram']:7.1f} tok/s, "
                  f"ratio {ratios[-1]:.2f}", flush=True)
        drafts, proposed = stats.num_drafts - drafts0, stats.num_draft_tokens - proposed0
        accepted = stats.num_accepted_tokens - accepted0
        rate = accepted / proposed if proposed else float("nan")
        length = 1 + accepted / drafts if drafts else float("nan")
        print(f"{name:<14} median ratio {statistics.median(ratios):.2f}; acceptance rate {rate:.2f}, mean accepted "
              f"length {length:.2f}, {drafts} verifications", flush=True)


if __name__ == "__main__":
    main()
