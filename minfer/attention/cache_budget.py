"""How many KV blocks a memory budget buys: bytes given, or a fraction of the device's free memory,
capped by what the running sequences could ever use."""

from __future__ import annotations

import os

import torch

from ..errors import BadSetting
from ..model_config import ModelConfig
from .kv_cache import KVCache, cdiv


def available_memory(device: torch.device) -> int:
    """Free bytes on the device: free GPU memory, or MemAvailable from /proc/meminfo on CPU."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


LONGEST_REQUIRED = 8192  # tokens: the longest sequence a KV cache budget must be able to hold
# Elements one layer's cache (slots, 2, Hkv, D) may hold: kernels that index it in 32 bits (Triton's) must not
# overflow. An H200's 0.9 of free memory bought Qwen3-0.6B 2.4G elements a layer, and its first CUDA-graph
# capture failed with an illegal memory access (scripts/gpu_check.sh, 2026-11-29).
MAX_LAYER_ELEMENTS = 2**31 - 1


def choose_num_blocks(
    config: ModelConfig,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    max_num_seqs: int,
    memory_bytes: int | None = None,
    memory_fraction: float | None = None,
    context_len: int | None = None,
    extra_bytes_per_block: int = 0,  # a second cache on the same blocks (a draft model's) shares the budget
) -> int:
    """Size the cache from a budget: bytes, or a fraction of free memory (default 0.9 on a GPU,
    0.25 on CPU). Never more than every running sequence at full context (the model's, or a shorter
    `context_len`) could use (plus as much again to keep prefixes cached) — more would be memory held
    for nothing. The budget must hold one sequence of the full context, or of LONGEST_REQUIRED tokens
    for long-context models (Qwen3's 40960 would need GBs): the scheduler refuses requests longer than
    the cache."""
    per_block = KVCache.bytes_per_block(config, block_size, dtype) + extra_bytes_per_block
    if memory_bytes is None:
        fraction = memory_fraction if memory_fraction is not None else (0.9 if device.type == "cuda" else 0.25)
        if not 0 < fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {fraction}")
        memory_bytes = int(available_memory(device) * fraction)
    blocks_per_seq = cdiv(context_len or config.max_positions, block_size)
    largest = MAX_LAYER_ELEMENTS // KVCache.layer_elements_per_block(config, block_size) - 1  # the null block too
    num_blocks = min(memory_bytes // per_block, 2 * max_num_seqs * blocks_per_seq, largest)
    needed = min(blocks_per_seq, cdiv(LONGEST_REQUIRED, block_size))
    if num_blocks < needed:
        length = "full-length" if needed == blocks_per_seq else f"{LONGEST_REQUIRED}-token"
        raise ValueError(
            f"the KV cache budget of {memory_bytes / 2**20:.2f} MiB holds {num_blocks} blocks, "
            f"fewer than the {needed} one {length} sequence needs; give more memory (--kv-cache-memory), "
            "a shorter --max-model-len, or --num-kv-blocks"
        )
    return int(num_blocks)


def check_num_blocks(config: ModelConfig, block_size: int, dtype: torch.dtype, device: torch.device,
                     num_blocks: int) -> None:
    """--num-kv-blocks as given, refused before anything is built if it cannot be: past a layer's 32-bit index,
    or more bytes than the device has free (a billion blocks took minutes of Python objects, then the memory)."""
    largest = MAX_LAYER_ELEMENTS // KVCache.layer_elements_per_block(config, block_size) - 1  # the null block too
    if num_blocks > largest:
        raise BadSetting(f"--num-kv-blocks {num_blocks} is more than the {largest} blocks of {block_size} tokens "
                         "one layer's cache may hold (kernels index it in 32 bits)")
    size, free = num_blocks * KVCache.bytes_per_block(config, block_size, dtype), available_memory(device)
    if size > free:
        raise BadSetting(f"--num-kv-blocks {num_blocks} is a {size / 2**30:.2f} GiB KV cache, more than the "
                         f"{free / 2**30:.2f} GiB free on {device}: give fewer blocks, or --kv-cache-memory SIZE")


def check_max_model_len(config: ModelConfig, max_model_len: int | None) -> None:
    """--max-model-len as given, within the model's context (the positions it was trained on)."""
    if max_model_len is not None and max_model_len > config.max_positions:
        raise BadSetting(
            f"--max-model-len {max_model_len} exceeds the model's context of {config.max_positions} tokens"
        )
