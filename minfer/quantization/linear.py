"""QuantizedLinear: what the int8 and int4 linears share, and how each picks its path per row count.

At batch 1 a linear is bound by the bytes of its weight: torch's weight-only kernels read int8 or
int4 weights and win by the bytes they save. With more rows the matmul becomes compute-bound, and
these kernels (which re-read the weight every few rows) lose to a bf16 GEMM, several times at 64
rows. So above `kernel_max_rows` rows the weight is dequantized to the activations' dtype and run
through the ordinary matmul: one pass over the weight, amortised over every row of the batch.
The crossover differs between formats and CPUs: `python scripts/quant_crossover.py` measures it.
A format may add a path between the two (`matmul`): int8 does (int8.py).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from torch import nn


class QuantizedLinear(nn.Module):
    """nn.Linear with a quantized (out, in) weight. Subclasses hold the weight and define `kernel`
    (the weight-only quantized matmul, for a few rows) and `dequantized` (the weight as a float
    matrix). Quantized tensors are parameters (requires_grad=False), so model.parameters() counts
    their bytes as they are."""

    kernel_max_rows = 4  # rows up to this go through the quantized kernel; more, through dequantize + GEMM
    # (each format sets its own: int8 16, int4 64, from scripts/quant_crossover.py on a Zen 4)

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out), no bias
        raise NotImplementedError

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:  # (out, in)
        raise NotImplementedError

    # In a graph whose weights are frozen in (compiled/step.py, --compile-model), Inductor lowers the
    # kernel's op to a GEMM of its own that widens the weights in registers: fast at every row count.
    kernel_when_compiled = False

    def uses_kernel(self, num_rows: int) -> bool:
        """Whether `num_rows` rows go through `kernel` (else: dequantize + GEMM)."""
        return num_rows <= self.kernel_max_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., in) -> (..., out)
        rows = x.reshape(-1, self.in_features)  # (M, in)
        if self.kernel_when_compiled and torch.compiler.is_compiling():
            y = self.with_bias(self.kernel(rows))
        else:
            y = self.matmul(rows)
        return y.view(*x.shape[:-1], self.out_features)

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out), bias included
        """The path for this many rows: the kernel, or dequantize + GEMM."""
        return self.with_bias(self.kernel(rows)) if self.uses_kernel(rows.shape[0]) else self.gemm(rows)

    def with_bias(self, y: torch.Tensor) -> torch.Tensor:
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def gemm(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out), bias included
        """Many rows: the weight dequantized to the rows' dtype, then one ordinary matmul."""
        bias = None if self.bias is None else self.bias.to(rows.dtype)
        return F.linear(rows, self.dequantized(rows.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


# The weight-only kernels' vectorised loops read bf16 activations (widened to fp32 in registers, on any
# AVX2 or AVX-512 CPU, native bf16 or not); fp32 activations fall to scalar loops. One GPT-2 124M pass of
# 48 linears at one row, 2 threads, Zen 4: int8 5.6 ms with bf16 rows against 43 ms with fp32 ones, int4
# 2.8 against 84 (the packed fp32 GEMM: 15). So fp32 rows are rounded to bf16 for a kernel (2^-9 of each
# value, below the weights' own rounding) and its result widened back: scripts/quant_ab.py measures it.
KERNEL_ACTIVATIONS = torch.bfloat16


def kernel_rows(rows: torch.Tensor) -> torch.Tensor:
    """rows (M, in) in the dtype a weight-only kernel runs fast on (KERNEL_ACTIVATIONS)."""
    return rows if rows.dtype == KERNEL_ACTIVATIONS else rows.to(KERNEL_ACTIVATIONS)


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_columns(x: torch.Tensor, width: int) -> torch.Tensor:
    """x (..., k) with zero columns appended up to `width` (a kernel's multiple); x itself if k == width."""
    return x if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def tiled_matmul(rows: torch.Tensor, out_features: int, step: int, weight_columns) -> torch.Tensor:
    """rows (M, in) @ W (in, out_features), W built `step` output columns at a time by
    weight_columns(start, stop) -> (in, stop - start): a quantized weight widened tile by tile into the
    reused buffer (`widening_buffer`), each tile used before the next overwrites it."""
    if step >= out_features:
        return rows @ weight_columns(0, out_features)  # (M, out)
    y = torch.empty(rows.shape[0], out_features, dtype=rows.dtype, device=rows.device)
    for start in range(0, out_features, step):
        stop = min(start + step, out_features)
        y[:, start:stop] = rows @ weight_columns(start, stop)
    return y


_buffers = threading.local()  # one per thread: two engines in two threads never share one


def widening_buffer(dtype: torch.dtype, device: torch.device, numel: int) -> torch.Tensor:
    """A reused (numel,) buffer for a tile of weights widened to `dtype`: a fresh tensor of a large
    weight's size would be new pages from the OS on every step, each faulted in on first touch. In a
    compiled graph (--compile-decode-step) a fresh one: the compiler plans its own buffers, and a global
    one written there is a mutation it must keep (int8 at 64 rows ran 1.56x bf16's time, 1.40x fresh).
    Made outside inference mode: an inference tensor could not be written by a later call outside it."""
    if torch.compiler.is_compiling():
        return torch.empty(numel, dtype=dtype, device=device)
    key = (dtype, torch.device(device))
    buffers = _buffers.__dict__.setdefault("by_kind", {})
    buffer = buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):
            buffer = buffers[key] = torch.empty(numel, dtype=dtype, device=device)
    return buffer[:numel]
