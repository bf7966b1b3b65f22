"""Where the quantized kernels stop paying: per row count, a model's linears run as bf16 packed
(the --dtype auto path), through the int8/int4 weight-only kernels, dequantized + GEMM, and, for int8,
with the rows split into two int8 halves or rounded to int8 once (--quantize-activations).

    python scripts/quant_crossover.py [--model /tmp/gpt2] [--rounds 3] [--rows 1,2,4,8,16,32,64,128,256]

Each row count times every linear of the model's first block (plus the LM head with --head) back to
back, the variants alternating, the best of --rounds kept. quantization/linear.py's QuantizedLinear
picks a path per row count (int8.py's Int8Linear: three buckets): this is how those were chosen.
"""

import argparse
import time

import torch

from minfer.cpu.packing import PackedLinear
from minfer.models.registry import load_model
from minfer.quantization import Int4Linear, Int8Linear
from minfer.quantization.int8 import dynamic_int8_mm, split_int8_mm


def best_ms(fn, reps: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="minfer-tiny")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--head", action="store_true", help="the LM head too")
    parser.add_argument("--dtype", default="bfloat16", help="the activations' (and the float linears') dtype")
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    dtype = getattr(torch, args.dtype)
    model = load_model(args.model, dtype=dtype)
    block = next(m for m in model.modules() if m.__class__.__name__ in ("Block", "DecoderLayer"))
    linears = [m for m in block.modules() if type(m) is torch.nn.Linear] + ([model.lm_head] if args.head else [])
    variants = {
        "bf16 packed": [PackedLinear(m) for m in linears],
        "int8 kernel": [Int8Linear.from_float(m) for m in linears],
        "int4 kernel": [Int4Linear.from_float(m, args.group_size) for m in linears],
    }
    variants["int8 deq+gemm"], variants["int4 deq+gemm"] = variants["int8 kernel"], variants["int4 kernel"]
    variants["int8 split"] = variants["int8 kernel"]  # rows as two int8 halves: split_int8_mm
    variants["int8 x int8"] = variants["int8 kernel"]  # rows rounded to int8 once: dynamic_int8_mm
    print(f"{'rows':>5}" + "".join(f"{name:>15}" for name in variants) + "   (ms, best of rounds)")
    for rows in map(int, args.rows.split(",")):
        xs = [torch.randn(rows, m.in_features, dtype=dtype) for m in linears]
        reps = max(2, 64 // rows)
        best = {name: float("inf") for name in variants}
        for _ in range(args.rounds):
            for name, mods in variants.items():
                if name == "int8 split":
                    run = lambda mods=mods, xs=xs: [split_int8_mm(x, m.qweight, m.scales) for m, x in zip(mods, xs)]
                elif name == "int8 x int8":
                    run = lambda mods=mods, xs=xs: [dynamic_int8_mm(x, m.qweight, m.scales) for m, x in zip(mods, xs)]
                elif name.endswith("kernel"):
                    run = lambda mods=mods, xs=xs: [m.kernel(x) for m, x in zip(mods, xs)]
                elif name.endswith("gemm"):
                    run = lambda mods=mods, xs=xs: [m.gemm(x) for m, x in zip(mods, xs)]
                else:
                    run = lambda mods=mods, xs=xs: [m(x) for m, x in zip(mods, xs)]
                best[name] = min(best[name], best_ms(run, reps))
        print(f"{rows:>5}" + "".join(f"{best[n]:>15.3f}" for n in variants))


if __name__ == "__main__":
    main()
