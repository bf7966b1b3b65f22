"""int8 weight-only: symmetric, one scale per output channel.

w[n, k] ~= q[n, k] * scale[n], q in [-127, 127] and scale[n] = max_k |w[n, k]| / 127, rounded to
the nearest number bf16 holds (at most 0.4% away): a row's largest weight maps to 127 (its quotient
is within 127 ± 0.5), and zero stays zero. Half the bytes of bf16; the rounding error is at most
scale / 2 per weight, about 0.2% of the row's largest weight. Why bf16: the kernel takes the scales
in the activations' dtype, bf16, so a scale bf16 cannot hold was rounded there, up to 0.4% off for
a whole row at once, an error that does not average out over a dot product as the weights' own
roundings do (int8 agreed with bf16's greedy tokens on 6 of 20 minfer-tiny prompts then, 7 now, and
on 14 and 15 of minfer-tiny-llama's; docs/quantization.md).

The kernel is torch.ops.aten._weight_int8pack_mm (CPU: AVX512/AVX2 paths for bf16 activations,
a scalar loop for fp32 ones, so an fp32 model's rows reach it as bf16: linear.py). It needs the
inner dimension to be a multiple of 16 with bf16 activations (other widths crash or give garbage
in torch 2.13): narrower weights get zero columns.

With `quantize_activations` (--quantize-activations) the activations are quantized too, each row
(token) to int8 with a scale of its own, and the matmul is int8 x int8 -> int32 (torch._int_mm,
VNNI on AVX512 CPUs; several rows in exact fp32 sums where there is no VNNI), as llama.cpp's Q8_0
does with blocks of 32. On one Zen 4 core that runs a
GPT-2 block at one row in half the time of the packed bf16 matmul, where _weight_int8pack_mm,
which converts every weight to float before multiplying, is compute-bound at 0.7x of it, and at
batches it stays ahead of bf16 (0.75-0.8x at 64 to 256 rows) where that kernel is 2.5x behind.
The price is a second rounding (each activation to 1/254 of its row's largest): see
docs/quantization.md for what it does to perplexity.

Without it, a few rows go through the weight-only kernel, many through the integers widened to the
rows' dtype and one matmul, and in between (on a CPU with int8 dot products) each row is split into
two int8 halves so that int8 x int8 keeps the kernel's exactness (`split_int8_mm`, Int8Linear).
"""

from __future__ import annotations

import torch
from torch import nn

from ..cpu.features import cpu_has_int8_dot
from .linear import (
    KERNEL_ACTIVATIONS,
    QuantizedLinear,
    kernel_rows,
    pad_columns,
    round_up,
    tiled_matmul,
    widening_buffer,
)

K_MULTIPLE = 16  # _weight_int8pack_mm's bf16 path reads the inner dimension 16 at a time


CHUNK_ELEMENTS = 1 << 22  # quantize this many weights at a time: fp32 temporaries stay ~16 MB each
GEMM_TILE_ELEMENTS = 1 << 22  # a batch's matmul widens this many weights at a time (8 MiB in bf16)
HAS_INT8_DOT = cpu_has_int8_dot()  # VNNI or AMX: torch._int_mm is fast


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (q int8 (out, in), scales fp32 (out,)). Row chunk by row chunk, so a
    (151936, 1024) embedding does not briefly need several fp32 copies of itself."""
    out_features, in_features = weight.shape
    q = torch.empty(out_features, in_features, dtype=torch.int8)
    scales = torch.empty(out_features)
    step = max(1, CHUNK_ELEMENTS // max(1, in_features))
    for start in range(0, out_features, step):
        w = weight[start : start + step].detach().float()  # (rows, in)
        s = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # (rows,): an all-zero row keeps a usable scale
        s = s.bfloat16().float()  # what the kernel reads (module docstring); the largest quotient stays < 127.5
        q[start : start + step] = torch.round(w / s[:, None]).clamp(-127, 127)
        scales[start : start + step] = s
    return q, scales


def dynamic_int8_mm(rows: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows (M, K) float @ (q (N, K) int8 * scales (N,))^T -> (M, N) in rows' dtype, each row of `rows`
    rounded to int8 with its own symmetric scale first: one int8 matmul, then both scales."""
    row_scales = rows.abs().amax(dim=1, keepdim=True).float().div_(127).clamp_(min=1e-12)  # (M, 1)
    rows_q = torch.round(rows.float() / row_scales)  # (M, K) integers, the row's largest at +-127
    if HAS_INT8_DOT or rows.shape[0] == 1:
        acc = torch._int_mm(rows_q.to(torch.int8), q.t())  # (M, N) int32: exact
    else:  # torch's int8 matmul has no fast kernel without int8 dot products (5-16x slower at 16-64 rows on
        # AVX2): the same sums in fp32, whose products (< 2**14) and sums below 2**24 are exact
        acc = widened_matmul(rows_q, q)
    # In place on one fp32 copy: int32 * fp32 with broadcasting is a slow mixed-dtype loop (2x, measured).
    return acc.float().mul_(scales).mul_(row_scales).to(rows.dtype)


def split_int8_mm(rows: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows (M, K) float @ (q (N, K) int8 * scales (N,))^T -> (M, N) in rows' dtype, each row taken as
    s * (hi + lo / 254): hi rounded to int8 at the row's own scale s, lo the remainder at s / 254, so a
    row is held to ~1.6e-5 of its largest value (bf16 holds each value to 2^-9 of itself). Both halves go
    through one int8 matmul of 2M rows, which reads the weight once."""
    M = rows.shape[0]
    x = rows.float()  # (M, K)
    s = x.abs().amax(dim=1, keepdim=True).div_(127).clamp_(min=1e-12)  # (M, 1)
    hi = torch.round(x / s)  # (M, K) in [-127, 127]
    lo = torch.round((x - hi * s).mul_(254 / s))  # the remainder, at most s / 2: in [-127, 127]
    acc = torch._int_mm(torch.cat([hi, lo]).to(torch.int8), q.t()).float()  # (2M, N): exact sums
    return acc[:M].add_(acc[M:], alpha=1 / 254).mul_(scales).mul_(s).to(rows.dtype)


def widened_matmul(rows: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """rows (M, K) @ q (N, K)^T -> (M, N) in rows' dtype, q widened to it exactly, tile by tile through one
    reused buffer (an int8 times a float loop is far slower than a float matmul)."""
    step = max(1, GEMM_TILE_ELEMENTS // q.shape[1])
    return tiled_matmul(rows, q.shape[0], step, lambda start, stop: widened(q[start:stop], rows.dtype).t())


def widened(q: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q (t, in) int8 as `dtype`, exactly, in the reused buffer (valid until the next call)."""
    return widening_buffer(dtype, q.device, q.numel()).view(q.shape).copy_(q)


def dequantize_int8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The float matrix (out, in) that (q, scales) stand for."""
    return (q.to(dtype) * scales.to(dtype)[:, None]).to(dtype)


class Int8Linear(QuantizedLinear):
    """A linear with an int8 per-channel weight: `Int8Linear.from_float(linear)`, or from (q, scales)."""

    # Rows per path (scripts/quant_crossover.py, docs/quantization.md). The weight-only kernel converts
    # every weight again for every few rows. On a CPU with int8 dot products (`rounds_batches`) it runs up
    # to 4 rows, then rows up to 32 are split into two int8 halves (split_int8_mm), and more go through
    # dequantize + GEMM: a GPT-2 block at 16 rows on an AMX Xeon took 1.45 ms in the kernel, 1.13 split
    # and 1.47 dequantized, bf16 0.63. Elsewhere the kernel runs up to 16 rows, then dequantize + GEMM.
    kernel_max_rows = 16
    rounds_batches = HAS_INT8_DOT
    ROUNDED_ROWS = (4, 32)  # (above, up to): the rows rounded to int8 where `rounds_batches`

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None):
        out_features, in_features = q.shape
        super().__init__(in_features, out_features, bias)
        self.padded_in = round_up(in_features, K_MULTIPLE)
        q = pad_columns(q, self.padded_in).contiguous()  # (out, in')
        if q.data_ptr() % 64:  # the kernel reads it with aligned loads: elsewhere (a safetensors buffer) it crashes
            q = q.clone()  # torch allocates on 64-byte boundaries
        self.qweight = nn.Parameter(q, requires_grad=False)
        self.scales = nn.Parameter(scales.float().contiguous(), requires_grad=False)  # (out,)
        # The kernel takes scales in its rows' dtype: a small copy, a buffer so that it moves with the model.
        self.register_buffer("kernel_scales", self.scales.to(KERNEL_ACTIVATIONS), persistent=False)  # (out,)
        self.quantize_activations = False  # True: every row count through dynamic_int8_mm (see above)

    @classmethod
    def from_float(cls, linear: nn.Linear) -> Int8Linear:
        return cls(*quantize_int8(linear.weight), linear.bias)

    def rounds_rows(self, num_rows: int) -> bool:
        """Whether this many rows are rounded to int8 too: every row count with --quantize-activations,
        else the middle bucket where the CPU has int8 dot products."""
        above, up_to = self.ROUNDED_ROWS
        return self.quantize_activations or (self.rounds_batches and above < num_rows <= up_to)

    def uses_kernel(self, num_rows: int) -> bool:  # a quantized kernel, int8 x int8 or weight-only
        return self.rounds_rows(num_rows) or num_rows <= self.kernel_max_rows

    def matmul(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out), bias included
        if self.rounds_rows(rows.shape[0]):
            mm = dynamic_int8_mm if self.quantize_activations else split_int8_mm
            return self.with_bias(mm(pad_columns(rows, self.padded_in), self.qweight, self.scales))
        return super().matmul(rows)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out): weight-only
        fast = kernel_rows(pad_columns(rows, self.padded_in)).contiguous()  # fp32 rows as bf16: see linear.py
        return torch.ops.aten._weight_int8pack_mm(fast, self.qweight, self.kernel_scales).to(rows.dtype)

    def gemm(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out), bias included
        """Many rows: the integers widened to the rows' dtype (exactly: |q| <= 127) and multiplied as they
        are, the scales applied to the output (M, out) rather than to the weight (out, in). One pass over
        the weight, where scaling it cost three (a broadcast multiply in bf16 ran ~9x slower than the
        widening): one GPT-2 block at 64 rows, 3.2 -> 2.1 ms (docs/quantization.md). Tile by tile through
        one reused buffer. fp16 keeps the scaled weight: its range cannot hold the unscaled sums."""
        if rows.dtype not in (torch.bfloat16, torch.float32):
            return super().gemm(rows)
        dtype = rows.dtype
        y = widened_matmul(rows, self.qweight[:, : self.in_features])  # (M, out), the weight (out, in) unscaled
        y.mul_(self.kernel_scales if dtype == self.kernel_scales.dtype else self.scales)
        return y if self.bias is None else y.add_(self.bias.to(dtype))

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:  # (out, in)
        return dequantize_int8(self.qweight[:, : self.in_features], self.scales, dtype)

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # (n,) -> (n, in)
        """Dequantized rows `ids` of the weight only: a tied embedding's lookup."""
        return dequantize_int8(self.qweight[ids, : self.in_features], self.scales[ids], dtype)

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(q (out, in), scales (out,)): the portable form quantize_int8 made."""
        return self.qweight[:, : self.in_features].contiguous(), self.scales
