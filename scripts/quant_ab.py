"""bf16 and quantized engines side by side: the same greedy requests through each, alternating, best of
--rounds (a shared, noisy CPU: alternation keeps the comparison fair, the best round drops stalls).

    python scripts/quant_ab.py --model /tmp/gpt2 [--batches 1,16,64] [--rounds 3] [--threads 1] [--dtype float32]

An AVX2-only CPU (no native bf16: --dtype auto is fp32 there) can be imitated on an AVX-512 one by
capping torch's kernels, oneDNN and MKL at AVX2 before Python starts:
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ... --dtype float32.

Batch 1 prints ms/token (a 4-token prompt, --output-len tokens, wall time / tokens: the prefill is
spread over them); larger batches print output tokens/s (32-token prompts). Each figure has its
time relative to the first variant beside it.
"""

import argparse
import time

from minfer import LLM, SamplingParams

VARIANTS = {
    "bf16": {},
    "int8": {"quantization": "int8"},
    "int8xint8": {"quantization": "int8", "quantize_activations": True},
    "int4": {"quantization": "int4"},
}
# The same with all-decode steps as one compiled graph (compiled/step.py): "bf16-step", ...; and
# with most steps through the whole forward, its weights frozen in (--compile-model): "bf16-whole", ...
PLAIN = list(VARIANTS.items())
VARIANTS |= {f"{name}-step": {**settings, "compile_decode_step": True} for name, settings in PLAIN}
VARIANTS |= {f"{name}-whole": {**settings, "compile_model": True} for name, settings in PLAIN}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minfer-tiny")
    parser.add_argument("--variants", default="bf16,int8,int8xint8,int4", help=f"from {', '.join(VARIANTS)}")
    parser.add_argument("--batches", default="1")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, help="CPU threads (default: every core)")
    parser.add_argument("--attention-backend", default="auto")
    parser.add_argument("--dtype", default="auto", help="of every variant (the first, unquantized, is named bf16)")
    args = parser.parse_args()
    names = args.variants.split(",")
    engines = {
        name: LLM(args.model, dtype=args.dtype, num_threads=args.threads, attention_backend=args.attention_backend,
                  **VARIANTS[name])
        for name in names
    }
    batches = [int(b) for b in args.batches.split(",")]
    greedy = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    best: dict[tuple[int, str], float] = {}
    for _ in range(args.rounds):
        for batch in batches:
            prompts = [[(7 * i + j) % 1000 + 10 for j in range(32 if batch > 1 else 4)] for i in range(batch)]
            for name, llm in engines.items():
                # warm: shapes compile
                llm.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
                start = time.perf_counter()
                llm.generate(prompts, greedy, use_tqdm=False)
                best[batch, name] = min(best.get((batch, name), float("inf")), time.perf_counter() - start)
    for batch in batches:
        cells = []
        for name in names:
            seconds = best[batch, name]
            figure = (f"{seconds / args.output_len * 1e3:.1f} ms/token" if batch == 1
                      else f"{batch * args.output_len / seconds:.1f} tok/s")
            cells.append(f"{name} {figure} ({seconds / best[batch, names[0]]:.2f}x time)")
        print(f"batch {batch}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
