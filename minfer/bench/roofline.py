"""The batch-1 decode floor: a decode step must read every weight once, so it cannot beat
weight bytes / memory bandwidth. Both are measured here, on the spot, next to minfer's
measured batch-1 TPOT; the ratio says how far from the hardware limit decoding runs.

Bandwidth is that of streaming-reading one large tensor (512 MiB, best of a few), on a CPU in memory given
2 MB pages from its first touch (cpu/huge_pages.py: on a 2-core Zen 4 VM a sum read 44-52 GB/s there, 26-30 in
pages moved after filling and 23-27 in 4 KB pages), the faster of two reads: a plain sum, and a batched
matvec over one contiguous part per thread (each thread streams one block: ~10% faster on a 2-core Zen 3, as
minfer's split one-row linears read). Decode reads weights and writes almost nothing. A copy's bandwidth
(read + write bytes) is reported beside it; on a shared CPU both vary by ~20%
from run to run, so compare figures from one run. A KV-cache read at batch 1 and
short context is small beside the weights and is left out.

Between the two sits the matmul floor: the model's own weight matmuls (fast paths
included), each run once at one row, back to back, nothing else. Its distance from
the bandwidth floor is what the matmul kernels leave on the table (a one-row matmul
reads weights slower than a plain sum does); the distance from it to the measured
TPOT is everything else a step does (attention, small ops, Python, sampling).
"""

from __future__ import annotations

import random
import time

import torch

from ..cpu.huge_pages import huge_page_tensor
from ..engine.scheduler import OnlineScheduler
from ..quantization import QuantizedEmbedding, quantization_of
from .offline import run_offline
from .workload import BenchRequest, sampleable_token_ids

COPY_BYTES = 512 * 2**20  # far beyond any cache, so the copy runs at memory speed


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of all parameters in their loaded dtype; parameters() yields the tied LM head/embedding once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


def best_time(op, device: torch.device, repeats: int = 5) -> float:
    """The fastest of `repeats` runs of op(), in seconds (on a GPU, synchronised around each run)."""
    best = float("inf")
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        op()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return best


def measure_bandwidth(device: torch.device, nbytes: int = COPY_BYTES, repeats: int = 5) -> tuple[float, float]:
    """(read, copy) bytes per second: a large tensor read (summed whole, or a part per thread), and copied
    (read + write counted)."""
    if device.type == "cpu":  # in 2 MB pages from the first touch: the fastest reads a VM gives (huge_pages.py)
        src, dst = huge_page_tensor(nbytes // 4).fill_(1.0), huge_page_tensor(nbytes // 4).zero_()
    else:
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)  # touched, so no page faults are timed
        dst = torch.zeros_like(src)
    parts = torch.get_num_threads() if device.type == "cpu" else 1
    rows = 512  # each part a (rows, n / P / rows) matrix, read as one matvec: the shape of a split linear
    per_thread = src[: src.numel() // (parts * rows) * parts * rows].view(parts, rows, -1)  # (P, rows, n/P/rows)
    ones = torch.ones(parts, 1, rows, device=device)  # (P, 1, rows)
    whole, split = best_time(src.sum, device, repeats), best_time(lambda: torch.bmm(ones, per_thread), device, repeats)
    read = nbytes / min(whole, split)
    copy = 2 * nbytes / best_time(lambda: dst.copy_(src), device, repeats)
    return read, copy


def weight_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's linear layers, as loaded (plain nn.Linear, a CPU fast path or a quantized linear),
    without the LM head, nor a quantized embedding's table (read a row at a time, not multiplied)."""
    tables = {id(m.table) for m in model.modules() if isinstance(m, QuantizedEmbedding)}
    return [m for m in model.modules()
            if m is not model.lm_head and id(m) not in tables and type(m).__name__.endswith("Linear")]


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters as stored: int8/int4 weights and their scales, when quantized."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


def weights_name(model: torch.nn.Module) -> str:
    """"bfloat16", or "int8 + bfloat16" for a quantized model (int8 weights, bf16 activations)."""
    dtype = str(model.dtype).removeprefix("torch.")
    method = quantization_of(model)
    return f"{method} + {dtype}" if method else dtype


def matmul_floor(model: torch.nn.Module, repeats: int = 5) -> float:
    """Seconds to run every weight matmul of the model once at one row: its linears and LM head, as
    loaded (CPU fast paths included), back to back. The weights total far more than any cache, so
    each is read from memory, as in a decode step."""
    matmuls = [*weight_linears(model), model.lm_head]
    inputs = [torch.randn(1, m.in_features, dtype=model.dtype, device=model.device) for m in matmuls]

    def run_all():
        for matmul, x in zip(matmuls, inputs):
            matmul(x)

    with torch.inference_mode():
        run_all()  # warm-up
        return best_time(run_all, model.device, repeats)


def batch1_tpot(scheduler: OnlineScheduler, prompt_len: int = 32, output_len: int = 64, seed: int = 0) -> float:
    """TPOT (seconds) of one request running alone: a random prompt, greedy, exactly output_len tokens."""
    context = scheduler.config.max_positions
    output_len = max(2, min(output_len, context // 2))
    prompt_len = max(1, min(prompt_len, context - output_len))
    ids = sampleable_token_ids(scheduler.tokenizer, scheduler.config.vocab_size)
    rng = random.Random(f"roofline/{seed}")
    requests = [
        BenchRequest(0, None, [rng.choice(ids) for _ in range(prompt_len)], prompt_len, n, 0.0) for n in (8, output_len)
    ]
    run_offline(scheduler, requests[:1], progress=False)  # warm-up
    return run_offline(scheduler, requests[1:], progress=False).records[0].tpot


def roofline(scheduler: OnlineScheduler, output_len: int = 64, seed: int = 0) -> dict:
    model = scheduler.model
    nbytes = weight_bytes(model)
    bandwidth, copy_bandwidth = measure_bandwidth(model.device)
    floor = nbytes / bandwidth
    matmuls = matmul_floor(model)
    tpot = batch1_tpot(scheduler, output_len=output_len, seed=seed)
    return {
        "device": str(model.device),
        "dtype": weights_name(model),
        "weight_bytes": nbytes,
        "bandwidth_gb_s": bandwidth / 1e9,
        "copy_bandwidth_gb_s": copy_bandwidth / 1e9,
        "floor_tpot_ms": floor * 1000,
        "matmul_floor_ms": matmuls * 1000,
        "measured_tpot_ms": tpot * 1000,
        "measured_over_floor": tpot / floor,
    }


def format_roofline(r: dict) -> str:
    return "\n".join(
        [
            f"{' Decode roofline (batch 1) ':=^50}",
            f"{'Weights (MB, ' + r['dtype'] + '):':<40} {r['weight_bytes'] / 1e6:<10.1f}",
            f"{'Memory bandwidth, read (GB/s):':<40} {r['bandwidth_gb_s']:<10.2f}",
            f"{'Memory bandwidth, copy r+w (GB/s):':<40} {r['copy_bandwidth_gb_s']:<10.2f}",
            f"{'Floor TPOT = weights / bandwidth (ms):':<40} {r['floor_tpot_ms']:<10.2f}",
            f"{'Matmul floor: weight matmuls alone (ms):':<40} {r['matmul_floor_ms']:<10.2f}",
            f"{'Measured batch-1 TPOT (ms):':<40} {r['measured_tpot_ms']:<10.2f}",
            f"{'Measured / floor:':<40} {r['measured_over_floor']:<10.2f}",
            "=" * 50,
        ]
    )
