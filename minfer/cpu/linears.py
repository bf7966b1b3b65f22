"""CPU linears: faster equivalents of nn.Linear, each chosen from what the CPU has.

models/gpt2.py is plain GPT-2 with nn.Linear; nothing in it knows about CPUs. For a model on
the CPU, prepare_model (prepare.py) calls `optimize_for_cpu(model)`, which swaps in faster
equivalents (paths 1-3); paged attention has CPU paths of its own (cpu/tiled_attention.py,
paths 4-5, the CPU's attention backend). Each path below
says why it exists and how to measure it: `python bench.py --profile` splits an
engine step into KV write, context read, attention, linears, LM head, sampling and
host time, so running it with and without a path shows what the path is worth.
Figures go stale and differ between CPUs; bench.py prints them for the machine at hand.

1. Prepacked linears (`PackedLinear`, cpu/packing.py). Eager `F.linear` hands the weight to
   MKL/oneDNN in its plain (out, in) layout every call, and their kernels for a
   decode step's few rows read it well below memory speed. oneDNN can reorder a
   weight once into its own blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
   the path torch.compile's CPU backend uses); the same matmul then runs faster
   at every row count, one row (memory-bound) or hundreds (compute-bound). The
   packed copy replaces the plain weight, so memory does not grow. A packed call costs more than
   F.linear's (~25 us against ~8 on a Zen 3), so a small weight stays plain (PACK_MIN_WEIGHTS). In
   fp32 with several threads, one row (a batch-1 decode step) runs on a second copy split along the
   input, a part per thread (`SplitRowLinear`, where `one_row_parts` finds it worth its memory).
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

from functools import lru_cache, partial

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..attention.cache_budget import available_memory
from .features import cpu_has_native_bf16
from .packing import PACKING_BATCH_HINT, LMHead, PackedLinear, SplitRowLinear


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
    # a model says: its first tensor may be int8
    dtype = getattr(model, "dtype", None) or next(model.parameters()).dtype
    packed = packing_available(dtype)
    if packed:
        if not pack:
            return
        make = partial(packed_for, parts=one_row_parts(model, dtype))
    elif dtype == torch.bfloat16:
        make = _as_bf16_storage
    else:
        return
    lm_head = getattr(model, "lm_head", None)
    if packed and type(lm_head) is nn.Linear and worth_packing(lm_head):
        model.lm_head = LMHead(lm_head.weight)
    for parent in list(model.modules()):
        for name, child in parent.named_children():
            if type(child) is nn.Linear and not (parent is model and name == "lm_head"):
                if not packed or worth_packing(child):
                    setattr(parent, name, make(child))


# oneDNN's packed call costs ~25 us where F.linear's costs ~8 (Zen 3, any row count): a weight smaller
# than this is done before packing pays it back. minfer-tiny's linears (64K weights) stay plain, 1.1x
# (64 rows) to 1.7x (one row) faster so. Read from memory, a weight pays it back sooner: a SmolLM-135M
# shape (random, fp32, 30 layers) ran batch 1 at 38.9 ms/token and 32 x (64 + 64) at 160 tok/s with its
# 576 x 576 projections packed (this minimum), 40.2 and 154 without (2**19), 40.7 and 157 with its
# 576 x 192 ones packed too (medians of 4 alternating rounds). GPT-2's and Qwen3's are all above it.
PACK_MIN_WEIGHTS = 2**18


def worth_packing(linear: nn.Linear) -> bool:
    return linear.weight.numel() >= PACK_MIN_WEIGHTS


# The split copies pay where a step streams the weights from memory: above this many bytes of linears
# (beyond the last-level caches seen so far; minfer-tiny's few hundred KB stay cached and plain).
SPLIT_ROW_MIN_BYTES = 128 * 2**20


def one_row_parts(model: nn.Module, dtype: torch.dtype) -> int:
    """How many parts a prepacked linear splits one row into (SplitRowLinear): one per thread, in fp32 (bf16
    is unmeasured), where the linears stream from memory and their copy fits in a quarter of the memory
    available; else 1, no copy."""
    threads = torch.get_num_threads()
    if dtype != torch.float32 or threads < 2:
        return 1
    copy_bytes = sum(m.weight.nbytes for name, m in model.named_modules()  # the linears that get packed
                     if type(m) is nn.Linear and name != "lm_head" and worth_packing(m))
    fits = copy_bytes <= available_memory(torch.device("cpu")) // 4
    return threads if SPLIT_ROW_MIN_BYTES <= copy_bytes and fits else 1


def packed_for(linear: nn.Linear, parts: int) -> PackedLinear:
    """The prepacked linear, with its one-row copy split in `parts` where that divides the input."""
    if parts > 1 and linear.in_features % parts == 0:
        return SplitRowLinear(linear, parts)
    return PackedLinear(linear)


def _as_bf16_storage(linear: nn.Linear) -> Bf16StorageLinear:
    linear.__class__ = Bf16StorageLinear  # same parameters, a different forward
    return linear
