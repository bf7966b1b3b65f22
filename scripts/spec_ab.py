"""Speculative decoding A/B in one process: plain, n-gram and (with --draft) draft-model engines side by
side, alternating request by request, so a shared machine's changing load falls on all alike (separate
bench.py runs one after the other caught a rising load on whichever ran second).

    python scripts/spec_ab.py [--model minfer-tiny-llama] [--rounds 3] [--num-threads 1] [--draft DIR] [--no-ngram]

Workloads: copy (bench.py --workload copy: held-out stories, then the first one's opening), batch 1;
free (random token prompts), batch 1; and 16 streams of random prompts at once. Prints tokens/s of each
engine per round, each speculating engine's ratio to plain, and its acceptance rate and mean accepted
length.
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
    p.add_argument("--model", default="minfer-tiny-llama", help="minfer-tiny-llama copies from its context")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--draft", default=None, help="a draft checkpoint: also run --speculative-method draft")
    p.add_argument("--no-ngram", action="store_true", help="leave the n-gram engine out")
    p.add_argument("--num-speculative-tokens", type=int, default=4)
    p.add_argument("--workloads", default="copy,free,16", help="which of copy, free, 16 (comma-separated)")
    args = p.parse_args()
    model_dir = resolve_model_dir(args.model)
    common = {"attention_backend": "eager", "num_threads": args.num_threads}
    k = {"num_speculative_tokens": args.num_speculative_tokens}
    engines = {"plain": LLM(str(model_dir), **common)}
    if not args.no_ngram:
        engines["ngram"] = LLM(str(model_dir), speculative_method="ngram", **k, **common)
    if args.draft:
        engines["draft"] = LLM(str(model_dir), speculative_method="draft", speculative_model=args.draft, **k, **common)
    plain = engines["plain"]
    loads = workloads(model_dir, plain.tokenizer, plain.model.config.vocab_size, random.Random(0))
    wanted = args.workloads.split(",")
    loads = {name: prompts for name, prompts in loads.items() if name.split()[0].rstrip(",") in wanted}
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    for name, prompts in loads.items():
        batch = 16 if name == "16 streams" else 1
        for llm in engines.values():
            run(llm, prompts[:1], 1, params)  # warm-up
        before = {label: _counts(llm) for label, llm in engines.items() if label != "plain"}
        ratios = {label: [] for label in before}
        for r in range(args.rounds):
            rates = {label: [0, 0.0] for label in engines}
            order = list(engines.items())
            for i in range(0, len(prompts), batch):  # a batch at a time, each engine in turn, rotating
                shift = (i // batch) % len(order)
                for label, llm in order[shift:] + order[:shift]:
                    tokens, seconds = run(llm, prompts[i : i + batch], batch, params)
                    rates[label][0] += tokens
                    rates[label][1] += seconds
            tps = {label: t / s for label, (t, s) in rates.items()}
            for label, values in ratios.items():
                values.append(tps[label] / tps["plain"])
            figures = ", ".join(f"{label} {v:7.1f} tok/s" for label, v in tps.items())
            shares = ", ".join(f"{label}/plain {values[-1]:.2f}" for label, values in ratios.items())
            print(f"{name:<14} round {r + 1}: {figures}; {shares}", flush=True)
        for label, (drafts0, proposed0, accepted0) in before.items():
            now = _counts(engines[label])
            drafts, proposed, accepted = (a - b for a, b in zip(now, (drafts0, proposed0, accepted0)))
            rate = accepted / proposed if proposed else float("nan")
            length = 1 + accepted / drafts if drafts else float("nan")
            print(f"{name:<14} {label}: median ratio {statistics.median(ratios[label]):.2f}; acceptance rate "
                  f"{rate:.2f}, mean accepted length {length:.2f}, {drafts} verifications", flush=True)


def _counts(llm: LLM) -> tuple[int, int, int]:
    stats = llm.scheduler.features.speculation.speculator.stats
    return stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens


if __name__ == "__main__":
    main()
