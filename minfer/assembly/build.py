"""build_engine: the one function where the core meets its features.

The core (minfer/engine/) runs a plain engine and builds no feature. This function reads an
EngineConfig, loads and prepares the model for the device at hand, chooses and warms up its
attention backend, builds each feature room the config asks for, and hands all of it to an
OnlineScheduler. `LLM`, the server and bench all start here.

    scheduler = build_engine(EngineConfig(model="minfer-tiny"))
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..attention.cache_budget import check_max_model_len, check_num_blocks, choose_num_blocks
from ..compiled import cuda_graphs
from ..compiled.forward import CompiledForward
from ..compiled.step import CompiledDecodeStep
from ..cpu.features import cpu_has_native_bf16, cpu_has_native_fp16
from ..cpu.huge_pages import in_huge_pages_soon
from ..cpu.thread_share import CpuShare
from ..cpu.threads import bound_before_minfer, cores_allowed, cpu_threads_wanted, threads_chosen
from ..engine.config import DTYPES, EngineConfig, dtype_name
from ..engine.features import Features
from ..engine.scheduler import OnlineScheduler
from ..model_config import ModelConfig
from ..models.config import read_config_json
from ..models.loader import resolve_model_dir
from ..models.registry import config_of, load_model
from ..parallel_sampling.forks import Forks
from ..quantization import running_quantization
from ..quantization.checkpoint import QuantizationSpec, QuantizedWeights
from ..scoring.scorer import Scoring
from ..speculative.draft import DraftProposer, load_draft_model
from ..speculative.speculation import Speculation
from ..speculative.speculator import Speculator
from ..structured.structured import Structured
from ..text.tokenizer import Tokenizer
from ..text.tokenizer_files import check_fits_model
from .compile_choice import lone_only, with_compile_choice
from .memory import with_profiled_budget
from .prepare import prepare_model

log = logging.getLogger("minfer")


def build_engine(
    config: EngineConfig, model: torch.nn.Module | None = None, tokenizer: Tokenizer | None = None
) -> OnlineScheduler:
    """An OnlineScheduler for `config`, with every feature it asks for. `model` (already loaded, as tests
    and benchmarks reuse one) and `tokenizer` are loaded from config.model when not given."""
    if model is None:
        model, tokenizer = load_for(config, tokenizer)
    else:
        tokenizer = tokenizer or Tokenizer.from_dir(model.model_dir)
        check_settings(config, model.config, model.dtype, model.device)  # before a draft's cache is built
    config = with_compile_choice(config, model)  # compile_model unset: on where it wins (compile_choice.py)
    model, attention = prepare_model(model, config)  # quantized, packed, its attention chosen and warmed up
    if model.device.type == "cpu":  # cpu/huge_pages.py: the weights each step streams, in 2 MB pages
        in_huge_pages_soon([*model.parameters(), *model.buffers()])
    context_len = config.max_model_len or model.config.max_positions
    draft = prepared_draft(config, model, context_len) if config.speculative_method == "draft" else None
    if model.device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory is None:
        config = with_profiled_budget(config, model, attention, context_len)  # every weight loaded; no cache yet
    speculation = None
    if config.speculative_method is not None:
        config, speculation = with_speculation(config, model, context_len, draft)
    step = None
    if config.compile_decode_step or config.compile_model:
        step = CompiledDecodeStep(model, whole=config.compile_model, lone_only=lone_only(config, model))
    graphs = cuda_graphs.wants_decode_graphs(model.device, config.enforce_eager, attention)
    compiled = None
    # compiled/forward.py: warm-ups, graphs, fallbacks, and what /health says of the compile cache
    if step or graphs or attention.compiles_per_shape or attention.compile_record is not None:
        compiled = CompiledForward(step, graphs, config.max_num_seqs, context_len, config.max_num_batched_tokens)
    threads = model.device.type == "cpu" and not threads_chosen(config.num_threads)
    features = Features(
        scoring=Scoring(model.config.vocab_size),
        forks=Forks(),
        speculation=speculation,
        structured=Structured(tokenizer, model.config.vocab_size, model.device, speculating=speculation is not None),
        compiled=compiled,
        threads=CpuShare() if threads else None,
        settings={
            "attention_backend": "compiled" if attention.name in ("compiled", "flex") else "eager",
            # told from the model: a quantized checkpoint is quantized without the flags, as it was written
            **running_quantization(model),
        },
    )
    return OnlineScheduler(model, tokenizer, config, attention=attention, features=features)


def prepared_draft(config: EngineConfig, model: torch.nn.Module, context_len: int) -> tuple[torch.nn.Module, object]:
    """The draft model of --speculative-method draft, loaded and prepared, and its attention backend:
    not quantized (a `minfer quantize` checkpoint loads as it was written) and uncompiled, a draft being
    small already. On a GPU on the plain backend too: its steps run outside the target's
    (compiled/forward.py), where flex could not compile them all before serving."""
    draft = load_draft_model(config, model, context_len, weights=QuantizedWeights())
    eager_attention = config.attention_backend if draft.device.type == "cpu" else "eager"
    plain = replace(config, quantization=None, quantization_group_size=None, quantize_activations=False,
                    compile_model=False, compile_decode_step=False, attention_backend=eager_attention)
    return prepare_model(draft, plain)


def with_speculation(
    config: EngineConfig, model: torch.nn.Module, context_len: int, draft: tuple | None = None
) -> tuple[EngineConfig, Speculation]:
    """The speculative decoding config.speculative_method asks for (`draft`: prepared_draft's, for "draft").
    A draft model's cache shares the target's blocks, so the budget buys fewer of them: the config comes
    back with their number fixed."""
    proposer = None
    if draft is not None:
        draft, draft_attention = draft
        extra = DraftProposer.bytes_per_block(draft, config.block_size)
        num_blocks = config.num_kv_blocks or kv_blocks(config, model, context_len, extra)
        config = replace(config, num_kv_blocks=num_blocks, kv_cache_memory=None, gpu_memory_utilization=None)
        proposer = DraftProposer(draft, draft_attention, num_blocks, config.block_size, model.config)
    speculator = Speculator(config.num_speculative_tokens, config.ngram_min, config.ngram_max, proposer)
    return config, Speculation(speculator, proposer)


def kv_blocks(config: EngineConfig, model: torch.nn.Module, context_len: int, extra_bytes_per_block: int) -> int:
    """How many KV blocks the budget buys when a second cache (a draft model's) shares them."""
    return choose_num_blocks(
        model.config, config.block_size, model.dtype, model.device, config.max_num_seqs, config.kv_cache_memory,
        config.gpu_memory_utilization, context_len, extra_bytes_per_block,
    )


def load_for(config: EngineConfig, tokenizer: Tokenizer | None = None) -> tuple[torch.nn.Module, Tokenizer]:
    """config.model loaded on its device, in its dtype, quantized as it loads if asked (the float model
    never sits in memory whole), and its tokenizer (unless given); the CPU's threads set first (the fp32 LM
    head is sliced per thread). A flag the model cannot take, or a tokenizer it cannot embed, is refused on
    its config.json alone, before a minute of loading weights."""
    device = torch.device(config.device)
    check_device(device)
    if device.type == "cpu":
        set_cpu_threads(config.num_threads)
    spec = None
    if config.quantization is not None:
        spec = QuantizationSpec(config.quantization, config.quantization_group_size, config.quantize_lm_head)
    dtype = resolve_dtype(config.dtype, device)
    if device.type == "cpu" and emulated_on_this_cpu(dtype):
        log.warning("minfer: %s on a CPU without it in hardware (%s): torch emulates it, batches run slower than "
                    "float32 (--dtype auto picks %s here); it halves the weights' memory", dtype_name(dtype),
                    "AVX512-BF16, AMX" if dtype == torch.bfloat16 else "AVX512-FP16, AMX-FP16",
                    dtype_name(resolve_dtype("auto", device)))
    model_dir = resolve_model_dir(config.model)  # a Hub id is fetched here
    config_json = read_config_json(model_dir)  # read once: the checks here and the loader share it
    model_config = config_of(*config_json)
    tokenizer = tokenizer or Tokenizer.from_dir(model_dir)
    check_fits_model(tokenizer.backend, model_config.vocab_size, model_dir)
    check_settings(config, model_config, dtype, device)
    model = load_model(model_dir, device=device, dtype=dtype, weights=QuantizedWeights(spec), config_json=config_json)
    return model, tokenizer


def check_settings(config: EngineConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device) -> None:
    """The flags that depend on the model, checked once, before anything is built (OnlineScheduler checks its own
    again, for whoever builds one without this function)."""
    check_max_model_len(model_config, config.max_model_len)
    if config.num_kv_blocks is not None:
        check_num_blocks(model_config, config.block_size, dtype, device, config.num_kv_blocks)


def emulated_on_this_cpu(dtype: torch.dtype) -> bool:
    """A 16-bit dtype this CPU has no arithmetic for (on a 2-core Zen 3, GPT-2 at 64 rows: bf16 0.64x and
    fp16 0.26x float32's speed)."""
    if dtype == torch.bfloat16:
        return not cpu_has_native_bf16()
    return dtype == torch.float16 and not cpu_has_native_fp16()


def resolve_dtype(dtype: torch.dtype | str | None, device: torch.device = torch.device("cpu")) -> torch.dtype:
    """A torch dtype from a dtype or a name; "auto" picks bf16 where it is fast, else fp32. None (no --dtype)
    is "auto" on a GPU, where every user wants half precision, and fp32 on a CPU, where bf16 is fast only on
    some machines."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is None:
        dtype = "auto" if device.type == "cuda" else "float32"
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def check_device(device: torch.device) -> None:
    """A clear error, before any loading, for a device this torch build cannot use."""
    if device.type == "cuda" and not torch.cuda.is_available():
        build = "is a CPU-only build" if torch.version.cuda is None else "sees no CUDA GPU"
        raise ValueError(f"--device {device}: this torch ({torch.__version__}) {build}; use --device cpu")


def set_cpu_threads(num_threads: int | None = None) -> int:
    """Give torch every core this process may use, unless told otherwise (cpu_threads_wanted). Decode is
    memory-bound and prefill compute-bound: both want every core. Call it before loading a model: the
    fp32 LM head is sliced once per thread at load time. Returns the thread count."""
    chosen = threads_chosen(num_threads)
    num_threads, cores = cpu_threads_wanted(num_threads), len(cores_allowed())
    if num_threads > cores:  # OpenMP's threads take turns on the cores, and every op waits for the last one
        log.warning("minfer: %d threads on the %d cores this process may use: they take turns, which is slower "
                    "(GPT-2 batch 1 on 2 cores: 31.9 ms/token with 4 threads, 21.3 with 2); --num-threads %d uses "
                    "them all", num_threads, cores, cores)
    if not chosen and bound_before_minfer():
        log.warning("minfer: OpenMP, told to bind threads (OMP_PROC_BIND, OMP_PLACES or GOMP_CPU_AFFINITY), bound "
                    "this thread to one core when torch was imported, before minfer: one thread; import minfer "
                    "first, or give --num-threads")
    torch.set_num_threads(num_threads)
    return num_threads
