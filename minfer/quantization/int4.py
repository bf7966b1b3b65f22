"""int4 weight-only: asymmetric, one scale and one offset per group of `group_size` weights in a row.

For each group of G consecutive weights of an output row, q in [0, 15] and
w ~= (q - 8) * scale + zero, scale = (max - min) / 15, zero = min + 8 * scale: torch's int4pack
convention (gpt-fast's), so the group's smallest and largest weights are exact. A quarter of the
bytes of bf16 plus 4 bytes of scale and offset per group (group 64: 4.5 bits a weight in fp16 terms).
Smaller groups fit the weights more closely and cost more scale bytes: the tutorial stage measures it.

Stored, a weight is its nibbles packed two to a byte, (out, in/2) uint8 (low nibble first), with
(in/G, out, 2) scales and offsets: plain, portable tensors. At load the nibbles are repacked into
the kernel's own layout by torch.ops.aten._convert_weight_to_int4pack_for_cpu (torch >= 2.6), which
wants out a multiple of 16 and in a multiple of G: other shapes are padded with zero weights. Out is
padded to a multiple of 64, where that layout is simple: per block of 64 rows, a (in, 32) byte matrix
holding row j in the low nibbles of column j and row j + 32 in the high ones. So rows can be read back
from the packed weight alone (`packed_rows`), and one copy serves the kernel, a tied embedding's
lookup and the dequantize-then-GEMM path of batches.
"""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from ..engine.config import GROUP_SIZES
from .int8 import CHUNK_ELEMENTS, GEMM_TILE_ELEMENTS
from .linear import (
    KERNEL_ACTIVATIONS,
    QuantizedLinear,
    kernel_rows,
    pad_columns,
    round_up,
    tiled_matmul,
    widening_buffer,
)

DEFAULT_GROUP_SIZE = 64  # see docs/quantization.md: the perplexity and speed of each size on minfer-tiny
BLOCK_N = 64  # out channels are padded to a multiple of 64, whole interleaved blocks on every CPU


@lru_cache(maxsize=None)
def interleave_width() -> int:
    """How many output channels torch's int4pack interleaves per block on this CPU: 64 where its kernels
    use AVX512, 32 with AVX2. Read off a probe matrix packed here, not assumed."""
    probe = (torch.arange(128 * 64) % 16).reshape(128, 64)  # (N, K) values in [0, 15]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe.to(torch.int32), 1)
    for width in (64, 32, 16):
        if torch.equal(_unpack(packed, width).long(), probe):
            return width
    raise RuntimeError("torch's int4pack layout is none this module knows (blocks of 16, 32 or 64 channels)")


def int4_kernel_available() -> bool:
    """Whether this torch has the CPU int4 ops (torch >= 2.6) and they run here."""
    ops = torch.ops.aten
    if not (hasattr(ops, "_convert_weight_to_int4pack_for_cpu") and hasattr(ops, "_weight_int4pack_mm_for_cpu")):
        return False
    try:
        packed = ops._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 32, dtype=torch.int32), 1)
        ops._weight_int4pack_mm_for_cpu(torch.zeros(1, 32), packed, 32, torch.zeros(1, 16, 2))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def quantize_int4(weight: torch.Tensor, group_size: int = DEFAULT_GROUP_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) float weight -> (nibbles uint8 (out, in'/2), scales_and_zeros fp32 (in'/G, out, 2)),
    in' = in rounded up to a multiple of the group size (the padding quantizes zeros)."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {GROUP_SIZES}, got {group_size!r}")
    step = max(1, CHUNK_ELEMENTS // max(1, weight.shape[1]))  # row chunks: bounded fp32 temporaries
    if weight.shape[0] > step:
        parts = [quantize_int4(weight[i : i + step], group_size) for i in range(0, weight.shape[0], step)]
        return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts], dim=1)
    N = weight.shape[0]
    w = pad_columns(weight.detach().float(), round_up(weight.shape[1], group_size))  # (N, K')
    groups = w.reshape(N, -1, group_size)  # (N, K'/G, G)
    low, high = groups.amin(dim=-1, keepdim=True), groups.amax(dim=-1, keepdim=True)
    scales = ((high - low) / 15).clamp(min=1e-12)  # (N, K'/G, 1)
    q = torch.round((groups - low) / scales).clamp(0, 15).to(torch.uint8).reshape(N, -1)  # (N, K')
    zeros = low + 8 * scales
    scales_and_zeros = torch.cat([scales, zeros], dim=-1).transpose(0, 1).contiguous()  # (K'/G, N, 2)
    return pack_nibbles(q), scales_and_zeros


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(N, K) values in [0, 15] -> (N, K/2) uint8, element 2i in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """(N, K/2) uint8 -> (N, K) uint8 values in [0, 15]."""
    return torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)


def packed_rows(packed: torch.Tensor, ids: torch.Tensor, width: int) -> torch.Tensor:
    """Rows `ids` (n,) of the values in [0, 15] that int4pack's `packed` (N', K'/2) holds, as (n, K') uint8.
    `width`: interleave_width(), read once outside any compiled graph."""
    # W channels a block: row j in the low nibbles of byte column j, row j + W/2 in the high ones
    blocks = packed.view(-1, packed.shape[1] * 2, width // 2)  # (N'/W, K', W/2)
    column = blocks[ids // width, :, ids % (width // 2)]  # (n, K'): each row's byte column
    high = (ids % width >= width // 2).to(torch.uint8)[:, None] * 4  # (n, 1): shift 4 for the upper half
    return (column >> high) & 15


def unpack_int4pack(packed: torch.Tensor) -> torch.Tensor:
    """int4pack's `packed` (N', K'/2) -> every value, (N', K') uint8 in [0, 15]."""
    return _unpack(packed, interleave_width())


def _unpack(packed: torch.Tensor, width: int) -> torch.Tensor:
    blocks = packed.view(-1, packed.shape[1] * 2, width // 2)  # (N'/W, K', W/2)
    both = torch.cat([blocks & 15, blocks >> 4], dim=-1)  # (N'/W, K', W): row j of the block at [:, j]
    return both.transpose(1, 2).reshape(-1, packed.shape[1] * 2)


def dequantize_values(q: torch.Tensor, scales_and_zeros: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """q (n, K') in [0, 15] with scales_and_zeros (K'/G, n, 2) -> the float matrix (n, K')."""
    n, groups = q.shape[0], scales_and_zeros.shape[0]
    sz = scales_and_zeros.to(dtype).transpose(0, 1)  # (n, K'/G, 2)
    w = (q.reshape(n, groups, -1).to(dtype) - 8) * sz[..., :1] + sz[..., 1:]  # (n, K'/G, G)
    return w.reshape(n, -1)


def dequantize_int4(nibbles: torch.Tensor, scales_and_zeros: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The float matrix (out, in') that (nibbles, scales_and_zeros) stand for; works on any subset of rows
    (nibbles (n, in'/2) with scales_and_zeros (in'/G, n, 2))."""
    return dequantize_values(unpack_nibbles(nibbles), scales_and_zeros, dtype)


class Int4Linear(QuantizedLinear):
    """A linear with an int4 group-wise weight: `Int4Linear.from_float(linear, group_size)`, or from the
    stored (nibbles, scales_and_zeros). The weight is kept only in the kernel's packed layout."""

    kernel_max_rows = 48  # unpacking nibbles costs a block ~3.5 ms at any row count: the kernel wins below ~56 rows

    def __init__(
        self,
        nibbles: torch.Tensor,
        scales_and_zeros: torch.Tensor,
        in_features: int,
        bias: torch.Tensor | None = None,
    ):
        groups, out_features, _ = scales_and_zeros.shape
        super().__init__(in_features, out_features, bias)
        self.padded_in = nibbles.shape[1] * 2
        self.group_size = self.padded_in // groups
        self.padded_out = round_up(out_features, BLOCK_N)
        self.interleave = interleave_width()  # read here, once: a compiled graph would trace the probe
        sz = scales_and_zeros.float()
        if self.padded_out != out_features:  # zero rows: nibbles 8 with zero scale and offset dequantize to 0
            pad = torch.full((self.padded_out - out_features, nibbles.shape[1]), 0x88, dtype=torch.uint8)
            nibbles = torch.cat([nibbles, pad])
            sz = torch.cat([sz, sz.new_zeros(groups, self.padded_out - out_features, 2)], dim=1)
        # Blocks of 64 rows pack independently: converting a few thousand rows at a time bounds the int32
        # temporaries the op wants (4 bytes a weight) for a large embedding.
        step = max(BLOCK_N, CHUNK_ELEMENTS // self.padded_in // BLOCK_N * BLOCK_N)
        packed = torch.cat([
            torch.ops.aten._convert_weight_to_int4pack_for_cpu(unpack_nibbles(nibbles[i : i + step]).to(torch.int32), 1)
            for i in range(0, self.padded_out, step)
        ])
        self.qweight = nn.Parameter(packed, requires_grad=False)  # the kernel's layout
        self.scales_and_zeros = nn.Parameter(sz.contiguous(), requires_grad=False)  # (K'/G, N', 2)
        # The kernel takes them in its rows' dtype: a small copy, a buffer so that it moves with the model.
        self.register_buffer("kernel_sz", self.scales_and_zeros.to(KERNEL_ACTIVATIONS), persistent=False)
        self._sz_as = {}

    @classmethod
    def from_float(cls, linear: nn.Linear, group_size: int = DEFAULT_GROUP_SIZE) -> Int4Linear:
        return cls(*quantize_int4(linear.weight, group_size), linear.in_features, linear.bias)

    def kernel(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out)
        fast = kernel_rows(pad_columns(rows, self.padded_in)).contiguous()  # fp32 rows as bf16: see linear.py
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(fast, self.qweight, self.group_size, self.kernel_sz)
        return (y[:, : self.out_features] if self.padded_out != self.out_features else y).to(rows.dtype)

    def gemm(self, rows: torch.Tensor) -> torch.Tensor:  # (M, in) -> (M, out), bias included
        """Many rows: the weight unpacked tile by tile straight into the matmul's (in, out) layout, a tile
        of 64-row blocks at a time through one reused buffer. There a group's scale and offset broadcast
        along each row of out channels, which torch's elementwise kernels run fast; in (out, in) order they
        broadcast along the last axis, and `dequantized` took 9 ms for one GPT-2 block's weights against
        ~1 here (docs/quantization.md). fp16 keeps `dequantized`, and so does a compiled graph
        (--compile-decode-step), where Inductor fuses it into one loop and this path's strided copies ran
        2.3x slower (GPT-2 int4, 64 requests)."""
        if rows.dtype not in (torch.bfloat16, torch.float32) or torch.compiler.is_compiling():
            return super().gemm(rows)
        dtype, x, K = rows.dtype, pad_columns(rows, self.padded_in), self.padded_in  # x (M, K')
        scale, offset = self.affine_by_column(dtype)  # (K'/G, 1, N') each
        W = self.interleave
        blocks = self.qweight.view(-1, K, W // 2)  # (N'/W, K', W/2): a block's row j in the low nibbles
        # of column j, row j + W/2 in the high ones

        def weight_columns(start: int, stop: int) -> torch.Tensor:  # out channels start:stop -> (K', stop - start)
            tile = blocks[start // W : stop // W]  # (n, K', W/2)
            n = tile.shape[0]
            w = widening_buffer(dtype, x.device, K * n * W).view(K, n, W)  # (K', n, W)
            w[:, :, : W // 2].copy_((tile & 15).transpose(0, 1))
            w[:, :, W // 2 :].copy_((tile >> 4).transpose(0, 1))
            grouped = w.view(-1, self.group_size, n * W)  # (K'/G, G, n * W)
            torch.addcmul(offset[..., start:stop], grouped, scale[..., start:stop], out=grouped)  # q * scale + offset
            return w.view(K, n * W)

        step = max(1, GEMM_TILE_ELEMENTS // (K * BLOCK_N)) * BLOCK_N  # whole blocks of 64 out channels a tile
        y = tiled_matmul(x, self.padded_out, step, weight_columns)[:, : self.out_features]  # (M, out)
        return y if self.bias is None else y.add_(self.bias.to(dtype))

    def affine_by_column(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`affine_in` laid out for the (in, out) weight: (K'/G, 1, N') each."""
        key = ("by column", dtype)
        if key not in self._sz_as:
            scale, offset = self.affine_in(dtype)  # (N', K'/G, 1)
            self._sz_as[key] = tuple(t.permute(1, 2, 0).contiguous() for t in (scale, offset))
        return self._sz_as[key]

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:  # (out, in)
        scale, offset = self.affine_in(dtype)  # (N', K'/G, 1) each
        q = unpack_int4pack(self.qweight).view(scale.shape[0], scale.shape[1], -1)  # (N', K'/G, G)
        w = torch.addcmul(offset, q, scale)  # (q - 8) * scale + zero in one pass, in the activations' dtype
        return w.view(self.padded_out, -1)[: self.out_features, : self.in_features]

    def affine_in(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, zero - 8 * scale), each (N', K'/G, 1) in `dtype`: w = q * scale + offset."""
        key = ("affine", dtype)
        if key not in self._sz_as:
            sz = self.scales_and_zeros.transpose(0, 1)  # (N', K'/G, 2)
            scale, zero = sz[..., :1], sz[..., 1:]
            self._sz_as[key] = (scale.to(dtype).contiguous(), (zero - 8 * scale).to(dtype).contiguous())
        return self._sz_as[key]

    def rows(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # (n,) -> (n, in)
        """Dequantized rows `ids` of the weight only: a tied embedding's lookup. (`ids.shape[0]`, not len(ids):
        traced, len() fixes the row count to the example's, and an exported graph could not take any other.)"""
        scale, offset = self.affine_in(dtype)  # (N', K'/G, 1) each
        n = ids.shape[0]
        q = packed_rows(self.qweight, ids, self.interleave).view(n, scale.shape[1], -1)  # (n, K'/G, G)
        return torch.addcmul(offset[ids], q, scale[ids]).view(n, -1)[:, : self.in_features]

    def stored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(nibbles (out, in'/2), scales_and_zeros (in'/G, out, 2)): the portable form quantize_int4 made."""
        q = unpack_int4pack(self.qweight)[: self.out_features]
        return pack_nibbles(q), self.scales_and_zeros[:, : self.out_features].contiguous()
