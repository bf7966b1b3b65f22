"""oneDNN's prepacked layout for the CPU's linears and LM head (paths 1 and 2 of cpu/linears.py).

Eager `F.linear` hands the weight to MKL/oneDNN in its plain (out, in) layout every call, and their
kernels for a decode step's few rows read it well below memory speed. oneDNN can reorder a weight
once into its own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, the path torch.compile's
CPU backend uses); the same matmul then runs faster at every row count. The packed copy replaces the
plain weight, so memory does not grow. `python bench.py --profile` shows what it is worth here.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.kv_cache import cdiv

PACKING_BATCH_HINT = 64  # oneDNN picks its blocking for about this many rows; good at 1 to 512 too


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """A (out, in) weight reordered into oneDNN's blocked layout (an opaque tensor, same numel)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKING_BATCH_HINT)


def padded_rows(n: int) -> int:
    """n rounded up to one of a few row counts: exact up to 16, then four steps per doubling (at most
    25% padding). oneDNN compiles and caches a kernel for every input shape it sees, about a MB each
    on GPT-2's matrices: a server's ever-changing token counts would grow memory by GBs without this."""
    if n <= 16:
        return n
    step = 1 << (n.bit_length() - 3)
    return cdiv(n, step) * step


def packed_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a weight from pack_weight: x (..., in) -> (..., out)."""
    if torch.compiler.is_compiling():  # in a compiled step (compiled/step.py): an op Inductor calls as it is
        return torch.ops.minfer.packed_linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])  # (M, in)
    M = rows.shape[0]
    padding = padded_rows(M) - M
    if padding:
        rows = F.pad(rows, (0, 0, 0, padding))  # zero rows, dropped below
    y = torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")  # (M', out)
    return y[:M].view(*x.shape[:-1], y.shape[-1])


# Inductor lowers mkldnn._linear_pointwise only for weights it froze and packed itself, so inside a
# compiled step the packed matmul is an opaque op (its eager body, above, runs as it is).
@torch.library.custom_op("minfer::packed_linear", mutates_args=())
def _packed_linear_op(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return packed_linear(x, weight, bias)


@_packed_linear_op.register_fake
def _(x, weight, bias):
    return x.new_empty(*x.shape[:-1], weight.shape[0])  # a packed weight keeps its (out, in) shape


class PackedLinear(nn.Module):
    """nn.Linear whose weight is held in oneDNN's blocked layout (see the module docstring, path 1)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(pack_weight(linear.weight), requires_grad=False)  # replaces the plain one
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach(), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)


class SplitRowLinear(PackedLinear):
    """A PackedLinear whose one row (a batch-1 decode step) runs on a second copy of the weight, split
    along the input: part p is rows p*K/P.. of W^T, (K/P, out), contiguous, one per thread, and the P
    partial rows are summed. Each thread streams one block of memory: 1.1-1.5x oneDNN's one-row speed
    on GPT-2's matrices (docs/performance.md, "AVX2-only CPUs"). Batches stay on the packed weight,
    where the split copy lost up to 1.5x. cpu/linears.py decides where the copy is worth its memory."""

    def __init__(self, linear: nn.Linear, parts: int):
        super().__init__(linear)
        K, N = self.in_features, self.out_features
        # Plain attributes, not parameters: a copy, and the model's weights stay as they were.
        self.split_weight = linear.weight.detach().t().reshape(parts, K // parts, N).contiguous()  # (P, K/P, N)
        self.split_bias = torch.zeros(parts, 1, N, dtype=linear.weight.dtype)  # the bias in part 0 only
        if linear.bias is not None:
            self.split_bias[0, 0] = linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() != self.in_features:  # compiled too: the split is plain torch, Inductor takes it as it is
            return packed_linear(x, self.weight, self.bias)
        P, part, N = self.split_weight.shape
        partials = torch.baddbmm(self.split_bias, x.reshape(P, 1, part), self.split_weight)  # (P, 1, N)
        return partials.sum(0).view(*x.shape[:-1], N)


class LMHead(nn.Module):
    """The LM head on a CPU (path 2): a prepacked copy of the (V, C) matrix for batches. In fp32 a
    single row also has a copy sliced per thread: (P, C, V/P), one contiguous slice per core run as a
    batched matmul. oneDNN's one-row GEMV reads the matrix at about half that speed, and a batch-1
    decode step spends a third of its bytes here. One more copy of the matrix buys it."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.vocab_size, self.in_features = weight.shape
        # Plain attributes, not parameters: these are copies, and the model's weights stay as they were.
        self.packed = pack_weight(weight)
        threads = torch.get_num_threads()
        self.sliced = None
        if weight.dtype == torch.float32 and threads > 1:
            V, C = weight.shape
            width = cdiv(V, threads)
            padded = torch.zeros(threads * width, C, dtype=weight.dtype)
            padded[:V] = weight
            self.sliced = padded.t().reshape(C, threads, width).permute(1, 0, 2).contiguous()  # (P, C, V/P)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (..., C) -> (..., V)
        if self.sliced is None or x.numel() != self.sliced.shape[1]:  # one row only
            return packed_linear(x, self.packed)
        P, C, width = self.sliced.shape
        logits = torch.bmm(x.reshape(1, 1, C).expand(P, 1, C), self.sliced)  # (P, 1, V/P): a slice per core
        return logits.transpose(0, 1).reshape(*x.shape[:-1], P * width)[..., : self.vocab_size]
