"""The server's start-up banner: what was loaded and every choice the engine made, in a few log lines.

An operator should not have to guess which dtype `--dtype auto` chose, how many KV blocks the
memory bought, or whether attention is compiled; vLLM and llama-server print the same facts.
"""

from __future__ import annotations

import torch

from ..attention.kv_cache import KVCache
from ..engine.config import dtype_name
from ..engine.scheduler import OnlineScheduler
from ..cpu.openmp import wait_policy
from ..cpu.threads import cores_allowed, threads_and_origin
from ..quantization import describe_quantization, num_parameters


def dtype_reason(asked: str | None, dtype: torch.dtype, device: torch.device) -> str:
    """Why the model runs in `dtype`: what was asked (None: nothing), and what auto saw."""
    name = dtype_name(dtype)
    if asked is None and device.type != "cuda":
        return f"{name} (the CPU's default; --dtype auto picks bf16 where this CPU computes it natively)"
    if asked not in ("auto", None):
        return f"{name} (as asked)"
    if device.type == "cuda":
        default = "the GPU's default, " if asked is None else ""
        return f"{name} ({default}auto: this GPU's fastest half-precision type)"
    if dtype == torch.bfloat16:
        return f"{name} (auto: this CPU computes bf16 natively: AVX512-BF16 or AMX)"
    return f"{name} (auto: no native bf16 on this CPU, where torch would emulate bf16 matmuls, slower than fp32)"


def banner_lines(scheduler: OnlineScheduler, asked_dtype: str, address: str, api_key: bool) -> list[str]:
    model, ran = scheduler.model, scheduler.engine_config
    params = num_parameters(model)  # a quantized matrix counts its weights, not its packed bytes
    arch = type(model).__name__
    threads = ""
    features = scheduler.features
    if model.device.type == "cpu":
        sharing = features.threads is not None and features.threads.enabled
        adapts = "; fewer while other processes use the cores" if sharing else ""
        # The count the engine was given: torch.get_num_threads() reads the calling thread's OpenMP setting,
        # and the server loads the model, setting it, on a thread of its own (serve.py in_passing_thread).
        n, origin = threads_and_origin(ran.num_threads)
        where = "" if origin == "one per core" else f", on {len(cores_allowed())} cores"  # the user's count
        threads = f", {n} thread{'s' * (n != 1)} ({origin}{where}{adapts})"
    attention = ran.attention_backend
    if scheduler.attention.name == "flex" and attention == "compiled":  # not where it fell back (compiled/forward.py)
        attention += ", FlexAttention over the block tables"
    if scheduler.attention.warm_up_seconds is not None:  # loaded from minfer's compile cache, or compiled
        cached = features.compiled.compile_cache().get("attention") if features.compiled is not None else None
        seconds = scheduler.attention.warm_up_seconds
        attention += f"; graphs {cached}" if cached else f" (warm-up compile {seconds:.1f} s)"
    if features.compiled is not None:
        attention += features.compiled.describe()  # compiled/forward.py: compiled steps, CUDA graphs
    blocks, block_size = ran.num_kv_blocks, ran.block_size
    kv_bytes = blocks * KVCache.bytes_per_block(model.config, block_size, model.dtype)
    quantized = describe_quantization(model)  # None unquantized
    return [
        f"model: {model.model_dir} ({arch}, {params / 1e6:.1f}M parameters)",
        f"dtype: {dtype_reason(asked_dtype, model.dtype, model.device)}",
        *([f"quantization: {quantized}"] if quantized else []),
        f"device: {model.device}{threads}; attention: {attention}",
        *([f"idle OpenMP threads: {wait_policy()}"] if model.device.type == "cpu" else []),
        f"KV cache: {blocks:,} blocks x {block_size} tokens = {blocks * block_size:,} tokens, "
        f"{kv_bytes / 2**20:,.0f} MiB; prefix caching {'on' if ran.enable_prefix_caching else 'off'}",
        f"max model len {ran.max_model_len:,}; max num seqs {ran.max_num_seqs}; "
        f"max num batched tokens {ran.max_num_batched_tokens}",
        f"listening on {address}; API key {'required' if api_key else 'off'}",
    ]
