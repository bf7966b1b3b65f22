"""CPU linears: faster equivalents of nn.Linear, each chosen from what the CPU has.

models/gpt2.py is plain GPT-2 with nn.Linear; nothing in it knows about CPUs. For a model on
the CPU, prepare_model (prepare.py) calls `optimize_for_cpu(model)`, which swaps in faster
equivalents (paths 1-3); paged attention has CPU paths of its own (cpu/tiled_attention.py,
paths 4-5, the CPU's attention backend). Each path below
says why it exists and how to measure it: `python bench.py --profile` splits an
engine step into KV write, context read, attention, linears, LM head, sampling and
host time, so running it with and without a path shows what the path is worth.
Figures go stale and differ between CPUs; bench.py prints them for the machine at hand.

1. Prepacked linears (`PackedLinear`). Eager `F.linear` hands the weight to
   MKL/oneDNN in its plain (out, in) layout every call, and their kernels for a
   decode step's few rows read it well below memory speed. oneDNN can reorder a
   weight once into its own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
   the path torch.compile's CPU backend uses); the same matmul then runs faster
   at every row count, one row (memory-bound) or hundreds (compute-bound). The
   packed copy replaces the plain weight, so memory does not grow.
2. The LM head, prepacked the same way (`LMHead`). Its weight is tied to the token
   embedding, which the input lookup still needs, so this is a second copy of the
   (V, C) matrix: worth it, the LM head is a third of GPT-2 small's weight bytes.
   In fp32 a one-row step uses a third copy, sliced per thread (see LMHead).
3. bf16, by hardware. With AVX512-BF16 or AMX, bf16 matmuls run natively, several
   times faster than fp32, and get packed like fp32. Without them (e.g. AVX2-only
   CPUs) torch emulates bf16 matmuls, several times slower than fp32: there
   `Bf16StorageLinear` keeps bf16 only as storage and computes batches in fp32.
"""

from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.kv_cache import cdiv
from .features import cpu_has_native_bf16

PACKING_BATCH_HINT = 64  # oneDNN picks its blocking for about this many rows; good at 1 to 512 too


@lru_cache(maxsize=None)
def packing_available(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU can prepack `dtype` weights: fp32 anywhere oneDNN runs, bf16
    only with native bf16 (oneDNN would emulate it elsewhere, or refuse). A trial pack decides."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16):
        return False
    if dtype == torch.bfloat16 and not cpu_has_native_bf16():
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PACKING_BATCH_HINT)
    except (RuntimeError, AttributeError):
        return False
    return True


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


class Bf16StorageLinear(nn.Linear):
    """bf16 weights on a CPU without native bf16 (path 3): a few rows are memory-bound and stay bf16
    (half the bytes to read); more rows would be emulated bf16 matmuls, so they compute in fp32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.numel() < 4 * x.shape[-1]:
            return F.linear(x, self.weight, self.bias)
        bias = None if self.bias is None else self.bias.float()
        return F.linear(x.float(), self.weight.float(), bias).to(x.dtype)


def optimize_for_cpu(model: nn.Module, pack: bool = True) -> None:
    """Swap every nn.Linear of `model` for its fast CPU equivalent, in place; `model.lm_head`, if it
    has one, becomes an LMHead. Calling it again changes nothing. `pack=False` leaves the linears
    that would be prepacked plain: for a graph with frozen weights, which Inductor packs itself."""
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype  # a model says: its first tensor may be int8
    if packing_available(dtype):
        if not pack:
            return
        make = PackedLinear
    elif dtype == torch.bfloat16:
        make = _as_bf16_storage
    else:
        return
    if make is PackedLinear and type(getattr(model, "lm_head", None)) is nn.Linear:
        model.lm_head = LMHead(model.lm_head.weight)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear and not (parent is model and name == "lm_head"):
                setattr(parent, name, make(child))


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


def _as_bf16_storage(linear: nn.Linear) -> Bf16StorageLinear:
    linear.__class__ = Bf16StorageLinear  # same parameters, a different forward
    return linear
