"""Where the quantized kernels stop paying: per row count, a model's linears run as bf16 packed
(the --dtype auto path), through the int8/int4 kernels, and dequantized to bf16 + GEMM.

    python scripts/quant_crossover.py [--model /tmp/gpt2] [--rounds 3] [--rows 1,2,4,8,16,32,64,128,256]

Each row count times every linear of the model's first block (plus the LM head with --head) back to
back, the variants alternating, the best of --rounds kept. quantization/linear.py's QuantizedLinear
picks the kernel up to `kernel_max_rows` rows and dequantize + GEMM above: this is how those were chosen.
"""

import argparse
import time

import torch
import torch.nn.functional as F

from minfer.engine.cpu_packing import PackedLinear
from minfer.models.registry import load_model
from minfer.quantization import Int4Linear, Int8Linear


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
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    model = load_model(args.model, dtype=torch.bfloat16)
    block = next(m for m in model.modules() if m.__class__.__name__ in ("Block", "DecoderLayer"))
    linears = [m for m in block.modules() if type(m) is torch.nn.Linear] + ([model.lm_head] if args.head else [])
    variants = {
        "bf16 packed": [PackedLinear(m) for m in linears],
        "int8 kernel": [Int8Linear.from_float(m) for m in linears],
        "int4 kernel": [Int4Linear.from_float(m, args.group_size) for m in linears],
    }
    variants["int8 deq+gemm"], variants["int4 deq+gemm"] = variants["int8 kernel"], variants["int4 kernel"]
    print(f"{'rows':>5}" + "".join(f"{name:>15}" for name in variants) + "   (ms, best of rounds)")
    for rows in map(int, args.rows.split(",")):
        xs = [torch.randn(rows, m.in_features, dtype=torch.bfloat16) for m in linears]
        reps = max(2, 64 // rows)
        best = {name: float("inf") for name in variants}
        for _ in range(args.rounds):
            for name, mods in variants.items():
                if name.endswith("kernel"):
                    run = lambda mods=mods, xs=xs: [m.kernel(x) for m, x in zip(mods, xs)]
                elif name.endswith("gemm"):
                    run = lambda mods=mods, xs=xs: [F.linear(x, m.dequantized(x.dtype)) for m, x in zip(mods, xs)]
                else:
                    run = lambda mods=mods, xs=xs: [m(x) for m, x in zip(mods, xs)]
                best[name] = min(best[name], best_ms(run, reps))
        print(f"{rows:>5}" + "".join(f"{best[n]:>15.3f}" for n in variants))


if __name__ == "__main__":
    main()
