"""A GPU's KV cache, sized as vLLM sizes it: after a profiling forward, before anything is captured.

--gpu-memory-utilization (0.9 by default) is the share of the GPU's *total* memory this engine may hold:
its weights, the activations of its largest step, the KV cache, and what CUDA holds beside torch. So,
once every weight is loaded and before the cache exists, one forward of the largest step the scheduler
makes (max_num_batched_tokens tokens, sampling max_num_seqs rows) measures torch's peak, and the cache
takes what is left:

    cache = utilization x total - peak - memory not torch's (CUDA's context, other processes)

CUDA graphs are captured after the cache, in what the share leaves (cuda_graphs.py keeps their logits in
one shared buffer). The profiling step's prompts are fresh, so attention reads only their own keys: sdpa,
nothing to compile.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..attention.kv_cache import cdiv
from ..attention.backend import AttentionBackend, StepLayout
from ..attention.paged import PagedBatch
from ..engine.config import EngineConfig

DEFAULT_UTILIZATION = 0.9  # vLLM's default share


@dataclass(frozen=True)
class DeviceMemory:
    """A reading after the profiling step, in bytes."""

    total: int  # the device's memory
    used: int  # in use by anyone: total - free
    peak: int  # torch's peak allocation during the step, weights included
    reserved: int  # what torch's allocator holds now


class CudaMemory:
    """Reads a CUDA device's memory around the profiling step."""

    def __init__(self, device: torch.device):
        self.device = device

    def reset_peak(self) -> None:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)

    def read(self) -> DeviceMemory:
        torch.cuda.synchronize(self.device)
        free, total = torch.cuda.mem_get_info(self.device)
        return DeviceMemory(
            total, total - free, torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        )


def kv_cache_budget(utilization: float, memory: DeviceMemory) -> int:
    """The bytes the KV cache may take; ValueError if the weights and the largest step leave none."""
    not_torch = max(memory.used - memory.reserved, 0)
    share = int(utilization * memory.total)
    budget = share - memory.peak - not_torch
    if budget <= 0:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} allows {share / 2**30:.2f} GiB, but the weights and the largest "
            f"step peaked at {memory.peak / 2**30:.2f} GiB, beside {not_torch / 2**30:.2f} GiB that torch does not "
            "hold: nothing is left for the KV cache. Raise --gpu-memory-utilization, or lower --max-num-batched-tokens"
        )
    return budget


@torch.inference_mode()
def profile_step(
    model: torch.nn.Module, attention: AttentionBackend, block_size: int, max_num_batched_tokens: int,
    max_num_seqs: int, context_len: int,
) -> int:
    """The largest step: max_num_batched_tokens tokens of fresh prompts (each at most context_len long), its
    last min(max_num_seqs, tokens) rows sampled, on a cache of their own. Returns the rows it ran."""
    N, B = max_num_batched_tokens, block_size
    lens = [min(context_len, N - start) for start in range(0, N, context_len)]
    num_blocks = sum(cdiv(n, B) for n in lens)
    cache = attention.new_cache(model.config, num_blocks, B, model.device, model.dtype)
    tables, starts, first_block, first_row = [], [], 0, 0
    for n in lens:
        tables.append(list(range(first_block, first_block + cdiv(n, B))))
        starts.append(first_row)
        first_block, first_row = first_block + cdiv(n, B), first_row + n
    positions = [p for n in lens for p in range(n)]
    slots = [table[p // B] * B + p % B for table, n in zip(tables, lens) for p in range(n)]
    device = model.device
    layout = StepLayout(torch.tensor(slots, device=device), starts, lens, lens, tables, B, cache.null_block)
    sample_rows = torch.arange(N - min(max_num_seqs, N), N, device=device)
    batch = PagedBatch(torch.tensor(positions, device=device), cache, attention.build_metadata(layout), sample_rows)
    logits = model(torch.zeros(N, dtype=torch.long, device=device), batch)  # (S, V)
    logits.float().softmax(-1)  # the sampler's fp32 copy of the logits, and one more
    return N


def with_profiled_budget(
    config: EngineConfig, model: torch.nn.Module, attention: AttentionBackend, context_len: int, memory=None
) -> EngineConfig:
    """`config` with the KV cache's size fixed in bytes (kv_cache_memory) from a profiling step: for a GPU
    whose cache the user left to the engine. `memory` reads the device (CudaMemory; tests give another)."""
    memory = memory or CudaMemory(model.device)
    memory.reset_peak()
    profile_step(
        model, attention, config.block_size, config.max_num_batched_tokens, config.max_num_seqs, context_len
    )
    utilization = config.gpu_memory_utilization or DEFAULT_UTILIZATION
    budget = kv_cache_budget(utilization, memory.read())
    return replace(config, kv_cache_memory=budget, gpu_memory_utilization=None)
