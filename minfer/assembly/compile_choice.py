"""Whether a CPU runs the whole forward compiled (--compile-model) when nobody said either way.

It does where it won at batch 1 and at batches alike, for models of MIN_PARAMETERS or more, with minfer's
compile cache open. There the first start compiles the forward into two AOTInductor packages (minutes) and
every later start loads them in seconds (compiled/packaged.py):
- on a CPU with AMX, for fp32 and bf16 models and int8 and int4 (weight-only) ones: docs/performance.md
  ("By default on AMX") has the side-by-side figures, each faster at batch 1, and as fast or faster at 64
  requests and 16 streams;
- on a CPU with AVX512-BF16 and no AMX (Zen 4, Zen 5), for fp32 and bf16 models: on a real Zen 4, batch 1
  1.2-1.3x (fp32) and 2.0-2.4x (bf16) eager's speed, 64 requests and 16 streams as fast (bf16) or as fast to 20%
  faster (fp32), its GEMMs autotuned between Inductor's templates and oneDNN ("Zen 4: AVX512-BF16, no AMX");
- for int8 and int4 models there, and on an AVX2-only CPU (fp32 activations), a lone sequence's decode alone
  (`lone_only`): compiled whole, they ran batch 1 1.1-3x faster but 64 requests 5-18% slower (int8 on an
  imitated Zen 4 and AVX2, int4 on a real Zen 4), so batches and prefill stay eager, and only the lone decode's
  package is built.

Elsewhere it stays off: other pairs were not measured faster without AMX; a small model (minfer-tiny, the
tests' checkpoints) would spend its first start compiling what runs in milliseconds; fp16,
--quantize-activations, speculative decoding and --compile-decode-step were not measured with it, or do not
compile with it; building the packages holds several copies of the weights at once, which must fit in the free
memory (BUILD_PEAK); and without the cache every start would compile again.
--compile-model forces it anywhere on a CPU; --no-compile-model or --enforce-eager keeps the plain path.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

import torch

from ..attention.cache_budget import available_memory
from ..compiled.artifacts import open_cache
from ..cpu.features import cpu_has_amx, cpu_has_native_bf16
from ..engine.config import EngineConfig
from ..quantization import num_parameters, quantization_of

log = logging.getLogger("minfer")

MIN_PARAMETERS = 50_000_000  # GPT-2 124M and up; minfer-tiny has ~1M
# The memory a first start's build takes, in the weights' bytes, by their quantization: Inductor's freezing,
# packing and writing of a package hold several copies at once. The peak above what the start held before it
# was 5.1x (GPT-2 124M bf16), 5.2x (Qwen3-0.6B bf16) and 5.8x (GPT-2 fp32), the checkpoint's pages included;
# 7.8x (GPT-2 int8) and 7.6x (int4). A build short of memory is killed, not refused.
BUILD_PEAK = {None: 7, "int8": 9, "int4": 9}
SHORT_OF_MEMORY = "building its packages takes about"  # how that reason opens: a start it keeps eager says so
# (dtype, weight quantization) pairs that compile by default, by what the CPU has
COMPILED_ON_AMX = {(torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int8"), (torch.float32, "int8"),
                   (torch.bfloat16, "int4"), (torch.float32, "int4")}
COMPILED_ON_AVX512_BF16 = {(torch.float32, None), (torch.bfloat16, None)}
# pairs whose batch package lost to eager there (eager rounds batches to int8 or widens the weights, the graph
# lowers every row count to the one-row kernel's GEMM): a lone sequence's decode alone compiles
LONE_ONLY_ON_AVX512_BF16 = {(torch.bfloat16, "int8"), (torch.bfloat16, "int4")}
LONE_ONLY_ON_AVX2 = {(torch.float32, "int8"), (torch.float32, "int4")}


def compiled_here() -> tuple[str, set, set]:
    """This CPU's kind, the (dtype, weight quantization) pairs it compiles by default, and those of them whose
    lone decode alone compiles."""
    if cpu_has_amx():
        return "AMX", COMPILED_ON_AMX, set()
    if cpu_has_native_bf16():
        return "AVX512-BF16", COMPILED_ON_AVX512_BF16 | LONE_ONLY_ON_AVX512_BF16, LONE_ONLY_ON_AVX512_BF16
    return "AVX2 alone", LONE_ONLY_ON_AVX2, LONE_ONLY_ON_AVX2


def lone_only(config: EngineConfig, model: torch.nn.Module) -> bool:
    """Whether the whole forward compiles for a lone sequence's decode alone, batches and prefill eager: where
    its batch package lost to eager on this CPU, whether the compile was chosen or asked for."""
    return (model.dtype, config.quantization or quantization_of(model)) in compiled_here()[2]


def why_not_compiled(config: EngineConfig, model: torch.nn.Module) -> str | None:
    """None where the whole forward compiles by default for this model and config, else why not."""
    if model.device.type != "cpu":
        return f"{model.device.type} is not a CPU"
    if config.enforce_eager or config.compile_decode_step or config.quantize_activations:
        return "another choice of how steps run was given"
    if config.speculative_method is not None:
        return "speculative decoding is not measured with it"
    kind, compiled, _ = compiled_here()
    quantization = config.quantization or quantization_of(model)
    if (model.dtype, quantization) not in compiled:
        return f"{model.dtype} with {quantization or 'unquantized'} weights is not compiled by default on {kind}"
    count = num_parameters(model)  # a quantized matrix counts its weights, not its packed bytes
    if count < MIN_PARAMETERS:
        return f"a small model ({count:,} parameters) would spend its first start compiling"
    short = short_of_memory(model, quantization)
    if short is not None:  # warm starts need less, but a first start must not be the one that dies
        return short
    if open_cache()[0] is None:
        return "minfer's compile cache is off: every start would compile again"
    return None


def short_of_memory(model: torch.nn.Module, quantization: str | None) -> str | None:
    """Why a first start's build of the packages would not fit in the free memory (BUILD_PEAK), else None."""
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    build, free = BUILD_PEAK[quantization] * weights, available_memory(model.device)
    if build <= free:
        return None
    return f"{SHORT_OF_MEMORY} {build / 2**30:.1f} GiB, more than the {free / 2**30:.1f} GiB free"


def with_compile_choice(config: EngineConfig, model: torch.nn.Module) -> EngineConfig:
    """`config` with compile_model decided, where it was left unset (None)."""
    if config.compile_model is not None:
        forced = config.compile_model and model.device.type == "cpu"
        short = short_of_memory(model, config.quantization or quantization_of(model)) if forced else None
        if short is not None:  # asked for: built all the same, but the user hears the risk first
            log.warning("minfer: --compile-model: if its packages are not in the cache yet, %s: the build may be "
                        "killed (--no-compile-model runs eager)", short)
        return config
    why_not = why_not_compiled(config, model)
    if why_not is None:
        log.info("minfer: compiling the whole forward%s, the default on a CPU with %s (--no-compile-model: eager); "
                 "the first start builds it (a minute or more), later ones load it",
                 " for a lone sequence's decode" if lone_only(config, model) else "", compiled_here()[0])
    elif why_not.startswith(SHORT_OF_MEMORY):  # the one reason a user of this CPU and model would not expect
        log.info("minfer: the whole forward stays eager, the default's compiled path needing more memory: %s "
                 "(--compile-model builds it all the same)", why_not)
    return replace(config, compile_model=why_not is None)
