"""One-row (batch-1 decode) linears: every route torch offers, per weight shape, timed on this CPU.

    python scripts/one_row_routes.py [--threads 2] [--models gpt2 qwen3-0.6b] [--stream-mb 256]

A batch-1 step reads each weight once, from memory: the caches hold none of it by the time it comes
round again. So each route cycles through copies of the weight, --stream-mb of them in all (0: one
copy, cache-hot, which flatters small matrices several times over). Routes, each checked against the
fp32 matmul before it is timed:
- fp32: oneDNN's prepacked linear (what minfer runs for batches), the copy split along the input, a
  part per thread (what it runs for one row with several threads; cpu/packing.py), F.linear on the
  (out, in) weight, x @ W with W stored (in, out), and a GEMV Inductor generates from `(w * x).sum(-1)`
  (static shapes);
- int8 (per-channel scales): torch's weight-only kernel `_weight_int8pack_mm` with bf16 rows (what
  minfer runs), and a GEMV Inductor generates from a plain-torch reduction over the weight's bytes;
- int8 x int8, the row rounded to int8 too: `torch._int_mm` with a symmetric scale per row (what
  --quantize-activations runs), and torch's x86 quantized engine (fbgemm), `quantized::linear_dynamic`,
  which rounds the rows of a call to uint8 with one scale and zero point (7 bits: reduce_range).
Prints a markdown table: microseconds a call, and the weight bytes read per second.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minfer.cpu.packing import PackedLinear, SplitRowLinear  # noqa: E402
from minfer.quantization.int8 import Int8Linear, dynamic_int8_mm  # noqa: E402

# (in, out) of each distinct linear, the LM head last
SHAPES = {
    "gpt2": [(768, 2304), (768, 768), (768, 3072), (3072, 768), (768, 50257)],
    "qwen3-0.6b": [(1024, 2048), (1024, 1024), (2048, 1024), (1024, 3072), (3072, 1024), (1024, 151936)],
    "tiny": [(64, 96), (128, 64)],  # for the test
}

MANTISSA_ONE = 0x4B000000  # the bits of the float 2**23: its mantissa's low byte is free for a byte b
BYTE_OFFSET = float(2**23 + 128)  # what (2**23 | (b ^ 0x80)) reads as, less the signed byte


def fp32_gemv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # x (K,), w (N, K) -> (N,)
    return (w * x).sum(-1)


def int8_gemv(x_planes: torch.Tensor, words: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x_planes (4, K/4): x[4i + j] at [j, i]; words (N, K/4) fp32 holding the int8 weight's bytes;
    scales (N,) -> (N,). torch 2.13's AVX2 Inductor code loads integer vectors through a memcpy and float
    vectors directly, so the bytes travel as fp32 words; a byte OR-ed into the mantissa of 2**23 is
    widened to float exactly, cheaper than an int-to-float conversion."""
    ints = words.view(torch.int32)  # (N, K/4)
    total = None
    for plane in range(4):
        byte = ((((ints >> (8 * plane)) & 0xFF) ^ 0x80) | MANTISSA_ONE).view(torch.float32) - BYTE_OFFSET
        total = byte * x_planes[plane] if total is None else total + byte * x_planes[plane]
    return total.sum(-1) * scales  # (N,)


def compiled(fn, enabled: bool):
    """A static-shape compile of fn for this shape: Dynamo's caches are reset first (it keeps at most 8
    graphs a function, then runs it eagerly)."""
    if not enabled:
        return None
    torch._dynamo.reset()
    return torch.compile(fn, dynamic=False)


def best_us(call, argument_sets, rounds: int = 3) -> float:
    """The best of `rounds` passes over every argument set (a weight copy each): microseconds a call."""
    for arguments in argument_sets[:2]:
        call(*arguments)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for arguments in argument_sets:
            call(*arguments)
        best = min(best, (time.perf_counter() - start) / len(argument_sets))
    return best * 1e6


def check(name: str, got: torch.Tensor, want: torch.Tensor, tolerance: float) -> None:
    error = (got.flatten() - want.flatten()).abs().max().item() / (want.abs().max().item() + 1e-12)
    if error > tolerance:
        raise SystemExit(f"one_row_routes: {name} differs from the fp32 matmul: relative error {error:.2e}")


def routes_for(k: int, n: int, stream_mb: float, compile_kernels: bool) -> dict[str, float]:
    """route name -> microseconds a call for one (in=k, out=n) weight at one row."""
    torch.manual_seed(0)
    x = torch.randn(1, k)
    fp32_copies = max(1, int(stream_mb * 1e6 // (4 * k * n)))
    linears = [torch.nn.Linear(k, n, bias=False) for _ in range(fp32_copies)]
    want = F.linear(x, linears[0].weight)  # (1, n)
    results = {}

    packed = [(PackedLinear(linear),) for linear in linears]
    check("fp32 prepacked", packed[0][0](x), want, 1e-5)
    results["fp32 prepacked"] = best_us(lambda p: p(x), packed)
    del packed
    parts = torch.get_num_threads()
    if parts > 1 and k % parts == 0:
        split = [(SplitRowLinear(linear, parts),) for linear in linears]
        check("fp32 split along the input", split[0][0](x), want, 1e-5)
        results["fp32 split along the input"] = best_us(lambda p: p(x), split)
        del split
    weights = [(linear.weight.detach(),) for linear in linears]
    results["fp32 F.linear"] = best_us(lambda w: F.linear(x, w), weights)
    gemv = compiled(fp32_gemv, compile_kernels)
    if gemv is not None:
        check("fp32 Inductor GEMV", gemv(x[0], weights[0][0]), want, 1e-5)
        results["fp32 Inductor GEMV"] = best_us(lambda w: gemv(x[0], w), weights)
    transposed = [(w.t().contiguous(),) for (w,) in weights]
    del weights
    check("fp32 x @ W(in, out)", x @ transposed[0][0], want, 1e-5)
    results["fp32 x @ W(in, out)"] = best_us(lambda w: x @ w, transposed)
    del transposed

    int8_copies = max(1, int(stream_mb * 1e6 // (k * n)))
    int8 = [Int8Linear.from_float(linears[i % len(linears)]) for i in range(int8_copies)]
    del linears
    want = x @ int8[0].dequantized(torch.float32).t()
    check("int8 torch kernel", int8[0].kernel(x), want, 1e-2)  # bf16 rows
    results["int8 torch kernel (bf16 rows)"] = best_us(lambda layer: layer.kernel(x), [(layer,) for layer in int8])
    gemv = compiled(int8_gemv, compile_kernels)
    if gemv is not None and k % 4 == 0:
        def planes():
            return x.view(-1, 4).t().contiguous()  # (4, K/4)
        weights = [(layer.qweight.detach()[:, :k].contiguous().view(torch.float32), layer.scales.detach())
                   for layer in int8]
        check("int8 Inductor GEMV", gemv(planes(), *weights[0]), want, 1e-5)
        results["int8 Inductor GEMV (fp32 rows)"] = best_us(lambda w, s: gemv(planes(), w, s), weights)
    results.update(int8_by_int8_routes(x, int8, want))
    return results


def int8_by_int8_routes(x: torch.Tensor, int8: list, want: torch.Tensor) -> dict[str, float]:
    """The routes that round the row to int8 as well: their error is the row's rounding on top of the
    weights' (checked loosely, a few % of the largest output)."""
    results = {}
    weights = [(layer.qweight.detach()[:, : x.shape[1]].contiguous(), layer.scales.detach().float()) for layer in int8]
    check("int8 x int8 _int_mm", dynamic_int8_mm(x, *weights[0]), want, 5e-2)
    results["int8 x int8 _int_mm (row rounded)"] = best_us(lambda q, s: dynamic_int8_mm(x, q, s), weights)
    if torch.backends.quantized.engine == "x86":  # torch's default where fbgemm is built in
        zero = torch.zeros(weights[0][0].shape[0], dtype=torch.long)
        packed = [(torch.ops.quantized.linear_prepack(
            torch._make_per_channel_quantized_tensor(q, s.double(), zero, 0), None),) for q, s in weights]
        check("int8 x int8 x86", torch.ops.quantized.linear_dynamic(x, packed[0][0], True), want, 5e-2)
        results["int8 x int8 x86 linear_dynamic"] = best_us(
            lambda p: torch.ops.quantized.linear_dynamic(x, p, True), packed)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--models", nargs="+", default=["gpt2", "qwen3-0.6b"], choices=sorted(SHAPES))
    parser.add_argument("--stream-mb", type=float, default=256, help="weight copies cycled per route (0: cache-hot)")
    parser.add_argument("--no-compile", action="store_true", help="skip the Inductor routes (no compiler here)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"threads {args.threads}, weights streamed from {args.stream_mb:g} MB of copies; "
          "µs a call (GB/s of weight read)")
    with torch.inference_mode():
        for model in args.models:
            header = None
            for k, n in SHAPES[model]:
                results = routes_for(k, n, args.stream_mb, not args.no_compile)
                if header is None:
                    header = list(results)
                    print(f"\n| {model} (in, out) | " + " | ".join(header) + " |")
                    print("| --- " * (len(header) + 1) + "|")
                cells = []
                for name in header:
                    us = results.get(name)
                    bytes_read = k * n * (1 if name.startswith("int8") else 4)
                    cells.append("–" if us is None else f"{us:.0f} ({bytes_read / us / 1e3:.3g})")
                print(f"| ({k}, {n}) | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
