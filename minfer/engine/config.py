"""EngineConfig: every engine setting in one dataclass, checked once, and the command-line flags made from it.

`LLM`, `OnlineScheduler`, the server (`python -m minfer.serve`) and the benchmarks each take one, so
a setting is written down once, here. Fields carry vLLM's names, and a field's flag is its name with
dashes (`block_size` is `--block-size`), as vLLM's are. A field is one `setting(...)` entry: its
default, its flag's help, its type on the command line and its check; `add_cli_arguments` and
`__post_init__` read them from the dataclass's fields, so a new setting needs no other line to be a
flag that is checked (then the code that uses it).

    EngineConfig(model="gpt2", block_size=32)          # ValueError naming --block-size if it is bad
    EngineConfig.add_cli_arguments(parser)             # --model, --device, ..., --num-threads
    EngineConfig.from_cli_args(parser.parse_args())
"""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field, fields
from decimal import Decimal
from typing import Any, NamedTuple

import torch

from .. import settings
from ..errors import is_int

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float64": torch.float64,  # a reference precision: see docs/sampling.md, "Seeds and batches"
    "fp64": torch.float64,
}
SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
SIZE_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_size(text: str | int) -> int:
    """Bytes from "2GiB", "512MiB", "1.5GB", "1e9" or a plain count (an int passes through)."""
    if is_int(text):
        return text
    if not isinstance(text, str):
        raise TypeError(f"a size is an int or a string, got {text!r}")
    found = re.fullmatch(r"(\d+(?:\.\d*)?(?:e[+-]?\d+)?)\s*([a-z]*)", text.strip().lower())
    if not found or found[2] not in SIZE_UNITS:
        raise ValueError(f"not a size: {text!r}")
    return int(Decimal(found[1]) * SIZE_UNITS[found[2]])


def dtype_name(dtype: str | torch.dtype) -> str:
    """A torch dtype's name ("bfloat16"); a name passes through."""
    return str(dtype).removeprefix("torch.") if isinstance(dtype, torch.dtype) else dtype


CPU_OR_CUDA = "cpu, or a CUDA device such as cuda or cuda:0"


def is_cpu_or_cuda(device: str) -> bool:
    """Whether torch names `device` a CPU or CUDA one: meta, mps, xpu, ... are devices, and fail at the first step."""
    try:
        return torch.device(device).type in ("cpu", "cuda")
    except RuntimeError:  # not a device name at all
        return False


def applies(flags: list[str]) -> str:
    return "applies" if len(flags) == 1 else "apply"


class Check(NamedTuple):
    ok: Callable[[Any], bool]
    must: str  # what a good value is, for the error message


QUANTIZATION_METHODS = ("int8", "int4")  # weight-only, quantization/
GROUP_SIZES = (32, 64, 128)  # int4's weights per scale
# Formats other tools write that users will meet; named in the error that refuses them.
FOREIGN_FORMATS = ("gptq", "awq", "bitsandbytes", "fp8", "gguf", "compressed-tensors", "marlin", "torchao")
POSITIVE = Check(lambda v: is_int(v) and v >= 1, "a positive integer")
BOOL = Check(lambda v: isinstance(v, bool), "True or False")
SPECULATIVE_METHODS = ("ngram", "draft")
KV_CACHE_SIZES = ("num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization")  # at most one may be given


def check_quantization_method(method: str | None) -> None:
    """ValueError with a sentence for a --quantization that names no method minfer has."""
    if method is None or method in QUANTIZATION_METHODS:
        return
    extra = ""
    if str(method).lower() in FOREIGN_FORMATS:
        extra = (f" ({method} checkpoints are not supported: load the full-precision checkpoint and pass "
                 "--quantization int8 or int4, or write one with `minfer quantize`)")
    raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {method!r}{extra}")


def check_quantization_flags(method: str | None, group_size: int | None = None, quantize_lm_head: bool = True,
                             quantize_activations: bool = False) -> None:
    """ValueError with a sentence for quantization flags minfer would not apply: a method it does not have, or a
    flag of one method given with another, or with none. EngineConfig's rule, and eval-ppl's and the room's."""
    check_quantization_method(method)
    if group_size is not None and method != "int4":
        raise ValueError("--quantization-group-size applies to --quantization int4 only")
    if quantize_activations and method != "int8":
        raise ValueError("--quantize-activations applies to --quantization int8 only")
    if not quantize_lm_head and method is None:
        raise ValueError("--no-quantize-lm-head applies with --quantization only (nothing is quantized)")


def setting(default, type, check: Check, help: str, convert=None, metavar: str | None = None):
    """One engine setting. `type` turns the flag's text into a value (bool: --flag / --no-flag);
    `convert` normalises what Python callers may also pass (a Path, a torch.dtype, "2GiB"), and
    `check` judges the result. None is allowed where the default is None: the engine chooses. A
    default that is an EnvVar is read when a config is made (minfer/settings): the environment's, else its own."""
    metadata = {"type": type, "check": check, "help": help, "convert": convert, "metavar": metavar, "env": None}
    if isinstance(default, tuple):  # (EnvVar, fallback)
        var, fallback = default
        return field(default_factory=lambda: var.get(fallback), metadata={**metadata, "env": var})
    return field(default=default, metadata=metadata)


def default_of(f):
    """A field's default as a config made now takes it."""
    return f.default_factory() if f.default is MISSING else f.default


def flag(f) -> str:
    return "--" + f.name.replace("_", "-")


def or_text(parse):
    """A flag's parser that leaves text it cannot parse as it is: EngineConfig then refuses it in its
    own words ("--block-size must be a positive integer, got 'abc'"), in one line."""

    def parse_or_keep(text: str):
        try:
            return parse(text)
        except ValueError:
            return text

    return parse_or_keep


@dataclass(frozen=True)
class EngineConfig:
    model: str = setting(
        "gpt2",
        str,
        Check(lambda v: isinstance(v, str) and v != "", "a checkpoint directory or Hub repo id"),
        "a local checkpoint directory, a model minfer ships (minfer-tiny, minfer-tiny-llama) or a Hub repo id"
        " (default: gpt2)",
        convert=lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v,
    )
    # $MINFER_DEVICE may change the default, as $MINFER_ATTENTION_BACKEND does below: the tests' way to
    # run on a GPU (tests/conftest.py).
    device: str = setting(
        (settings.DEVICE, "cpu"),
        str,
        Check(is_cpu_or_cuda, CPU_OR_CUDA),
        "cpu, cuda, cuda:1, ... (default: $MINFER_DEVICE, else cpu)",
        convert=lambda v: str(torch.device(v)),
    )
    # Unset, the device decides (assembly/build.py's resolve_dtype): a GPU runs "auto", a CPU float32.
    dtype: str | None = setting(
        (settings.DTYPE, None),
        str,
        Check(lambda v: v == "auto" or v in DTYPES, f"'auto' or one of {sorted(DTYPES)}"),
        "float32, bfloat16, float16, float64, or auto (bf16 where it is fast, else fp32) (default: $MINFER_DTYPE, "
        "else auto on a GPU and float32 on a CPU)",
        convert=dtype_name,
    )
    # Seeds torch's global RNG when the engine starts: what sampling draws from for requests without a seed.
    seed: int = setting(
        0,
        int,
        Check(lambda v: is_int(v) and 0 <= v < 2**64, "an integer in [0, 2**64)"),
        "seeds sampling for requests that bring no seed of their own",
    )
    max_num_seqs: int = setting(64, int, POSITIVE, "requests running at once")
    max_num_batched_tokens: int = setting(512, int, POSITIVE, "tokens in one engine step (prefill chunks and decodes)")
    block_size: int = setting(16, int, POSITIVE, "tokens per KV cache block")
    num_kv_blocks: int | None = setting(None, int, POSITIVE, "KV cache size in blocks (default: sized from memory)")
    kv_cache_memory: int | None = setting(
        None,
        str,
        Check(lambda v: is_int(v) and v > 0, "a size in bytes above 0, such as 2GiB, 512MiB or 1e9"),
        "KV cache size in bytes: 2GiB, 512MiB, 1e9 (default: a quarter of free RAM on CPU)",
        convert=parse_size,
        metavar="SIZE",
    )
    gpu_memory_utilization: float | None = setting(
        None,
        float,
        Check(lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= 1, "a fraction in (0, 1]"),
        "CUDA only: the share of the GPU's total memory the engine may hold: weights, its largest step (measured "
        "by a profiling step at start-up) and the KV cache, which takes the rest (default: 0.9)",
        metavar="FRACTION",
    )
    enable_prefix_caching: bool = setting(True, bool, BOOL, "reuse the KV blocks of prompt prefixes seen before")
    max_model_len: int | None = setting(
        None, int, POSITIVE, "longest request (prompt + max_tokens) in tokens (default: the model's context)"
    )
    # Like vLLM's VLLM_ATTENTION_BACKEND, an environment variable may change the default (the tests
    # default to eager this way: compiling costs every new process a few seconds).
    attention_backend: str = setting(
        (settings.ATTENTION_BACKEND, "auto"),
        str,
        Check(lambda v: v in ("auto", "compiled", "eager"), "one of auto, compiled, eager"),
        "auto: compiled where it compiles and matches eager (a CPU, bf16/fp16), else eager (default: "
        "$MINFER_ATTENTION_BACKEND, else auto)",
    )
    enforce_eager: bool = setting(
        False, bool, BOOL, "never compile, no CUDA graphs: eager PyTorch only (implies --attention-backend eager)"
    )
    compile_decode_step: bool = setting(
        False, bool, BOOL, "CPU only: in all-decode steps, run each transformer block through one torch.compile "
        "graph shared by every layer, which fuses the small ops between the matmuls; compiled at start-up (seconds)",
    )
    compile_model: bool | None = setting(
        None, bool, BOOL, "CPU only: one compiled graph of the whole forward, weights frozen in, kept as packages "
        "in minfer's cache: a first start of minutes, later ones load them (default: where it wins: AMX; bf16, int4 "
        "on AVX512-BF16, int8 lone decodes without AMX, int4 ones on AVX2; models of 50M+ parameters, 7-9x their "
        "size free)",
    )
    num_threads: int | None = setting(
        None, int, POSITIVE, "CPU only: torch threads (default: every core this process may use)"
    )
    generation_config: str = setting(
        "auto",
        str,
        Check(lambda v: v in ("auto", "vllm") or os.path.isdir(v), "auto, vllm or a directory"),
        "auto: requests default to the checkpoint's generation_config.json sampling settings; vllm: "
        "the API's defaults; DIR: that directory's generation_config.json",
        convert=str,
    )
    quantization: str | None = setting(
        None,
        str,
        # Any text passes here: __post_init__ refuses what is not a method, naming what is supported.
        Check(lambda v: isinstance(v, str), f"one of {', '.join(QUANTIZATION_METHODS)}"),
        "weight-only quantization of every linear, the LM head and the token embedding: int8 (per "
        "channel) or int4 (group-wise); default: none",
        convert=lambda v: v.lower() if isinstance(v, str) else v,
    )
    quantization_group_size: int | None = setting(
        None,
        int,
        Check(lambda v: v in GROUP_SIZES, f"one of {', '.join(map(str, GROUP_SIZES))}"),
        "int4 only: weights per scale (default: 64)",
    )
    quantize_lm_head: bool = setting(
        True, bool, BOOL, "with --quantization: quantize the LM head and the token embedding (tied or not) too"
    )
    quantize_activations: bool = setting(
        False, bool, BOOL, "with --quantization int8: round each linear's input rows to int8 too and multiply "
        "int8 x int8 (as llama.cpp's Q8_0 does): faster at every batch size, a second rounding"
    )

    # Speculative decoding (engine/speculative/): propose tokens cheaply, verify them in one forward.
    speculative_method: str | None = setting(
        None,
        str,
        Check(lambda v: v in SPECULATIVE_METHODS, f"one of {', '.join(SPECULATIVE_METHODS)}"),
        "speculative decoding: ngram (prompt lookup: propose what followed the last n tokens earlier "
        "in the sequence) or draft (a smaller model with the same vocabulary, --speculative-model, "
        "proposes greedily); default: none",
    )
    num_speculative_tokens: int | None = setting(
        None, int, POSITIVE, "with --speculative-method: tokens proposed per step (default: 4)"
    )
    ngram_min: int | None = setting(None, int, POSITIVE, "ngram: shortest suffix to look up (default: 2)")
    ngram_max: int | None = setting(None, int, POSITIVE, "ngram: longest suffix to look up (default: 4)")
    speculative_model: str | None = setting(
        None,
        str,
        Check(lambda v: isinstance(v, str) and v != "", "a checkpoint directory"),
        "the draft model of --speculative-method draft: a checkpoint directory (or built-in name) with "
        "the target's vocabulary; it runs in the target's dtype, with a KV cache of its own",
        convert=lambda v: os.fspath(v) if isinstance(v, os.PathLike) else v,
    )

    def __post_init__(self):
        for f in fields(self):
            given = getattr(self, f.name)
            if given is None and default_of(f) is None:
                continue  # unset: the engine chooses
            check, convert = f.metadata["check"], f.metadata["convert"]
            try:
                value = convert(given) if convert else given
                ok = check.ok(value)
            except (TypeError, ValueError, RuntimeError):  # what torch.device and parse_size raise
                ok = False
            if not ok:  # name where the value came from: a flag, or the variable that set its default
                var = f.metadata["env"]
                source = f"{var.name} (the default {flag(f)})" if var and var.get() == given else flag(f)
                raise ValueError(f"{source} must be {check.must}, got {given!r}")
            object.__setattr__(self, f.name, value)  # frozen: checked once, then never changed
        device = torch.device(self.device).type
        if self.gpu_memory_utilization is not None and device != "cuda":
            raise ValueError(
                f"--gpu-memory-utilization is a share of GPU memory, for CUDA devices only; on {self.device} "
                "size the KV cache with --kv-cache-memory SIZE (or --num-kv-blocks)"
            )
        if self.compile_decode_step and device != "cpu":
            raise ValueError(f"--compile-decode-step is for --device cpu for now, not {self.device}")
        if self.compile_decode_step and self.enforce_eager:
            raise ValueError("--compile-decode-step compiles, --enforce-eager never does: give one")
        if self.compile_model and device != "cpu":
            raise ValueError(f"--compile-model is for --device cpu for now, not {self.device}")
        if self.compile_model and self.enforce_eager:
            raise ValueError("--compile-model compiles, --enforce-eager never does: give one")
        # --enforce-eager overrides $MINFER_ATTENTION_BACKEND=compiled, a default, not --attention-backend compiled
        asked = self.attention_backend == "compiled" and settings.ATTENTION_BACKEND.get() != "compiled"
        if self.enforce_eager and asked:
            raise ValueError("--attention-backend compiled compiles, --enforce-eager never does: give one")
        if self.compile_model and self.compile_decode_step:
            raise ValueError("--compile-model and --compile-decode-step each compile the steps: give one")
        if self.num_threads is not None and device != "cpu":
            raise ValueError(f"--num-threads sets CPU threads: it applies to --device cpu, not {self.device}")
        check_quantization_flags(self.quantization, self.quantization_group_size, self.quantize_lm_head,
                                 self.quantize_activations)
        if self.quantize_activations and self.compile_model:  # it would compile, fail, then run eager
            raise ValueError(
                "--quantize-activations does not compile under --compile-model (Inductor's int8 x int8 GEMM fails "
                "to lower in this torch): give one, or --compile-decode-step, which compiles it"
            )
        self._check_speculative()
        sizes = [flag(f) for f in fields(self) if f.name in KV_CACHE_SIZES and getattr(self, f.name) is not None]
        if len(sizes) > 1:
            raise ValueError(f"{' and '.join(sizes)} each set the KV cache size: give one")

    def _check_speculative(self) -> None:
        """The speculative options make sense together; fill in the defaults a method implies."""
        options = ("num_speculative_tokens", "ngram_min", "ngram_max", "speculative_model")
        if self.speculative_method is None:
            given = [flag(f) for f in fields(self) if f.name in options and getattr(self, f.name) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} {applies(given)} only with --speculative-method")
            return
        if self.speculative_method == "draft":
            if self.speculative_model is None:
                raise ValueError("--speculative-method draft needs --speculative-model DIR (the draft checkpoint)")
            ngram = [flag(f) for f in fields(self) if f.name.startswith("ngram_") and getattr(self, f.name) is not None]
            if ngram:
                raise ValueError(f"{', '.join(ngram)} {applies(ngram)} to --speculative-method ngram, not draft")
            if self.num_speculative_tokens is None:
                object.__setattr__(self, "num_speculative_tokens", 4)
            return
        if self.speculative_model is not None:
            raise ValueError("--speculative-model applies to --speculative-method draft, not ngram")
        defaults = {"num_speculative_tokens": 4, "ngram_min": 2, "ngram_max": 4}
        for name, value in defaults.items():
            if getattr(self, name) is None:
                object.__setattr__(self, name, value)
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"--ngram-min ({self.ngram_min}) must be <= --ngram-max ({self.ngram_max})")

    # ---- the command line ------------------------------------------------------------

    @classmethod
    def add_cli_arguments(cls, parser, exclude: tuple[str, ...] = ()) -> None:
        """One flag per field (but those in `exclude`, which the caller defines itself), default from the field,
        shown in --help unless the help says it. Text that is no number stays text, for from_cli_args to refuse."""
        for f in fields(cls):
            if f.name in exclude:
                continue
            meta, default = f.metadata, default_of(f)
            shown = "default:" in meta["help"] or "(default" in meta["help"] or default is None or default is False
            text = meta["help"] if shown else meta["help"] + " (default: %(default)s)"
            if meta["type"] is bool:
                parser.add_argument(flag(f), action=argparse.BooleanOptionalAction, default=default, help=text)
            else:
                metavar = meta["metavar"] or ("N" if meta["type"] is int else None)
                parser.add_argument(flag(f), type=or_text(meta["type"]), default=default, metavar=metavar, help=text)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides) -> EngineConfig:
        """The config from parsed flags (fields missing from `args` keep their defaults); ValueError
        naming the flag if a value is bad."""
        values = {f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)}
        return cls(**{**values, **overrides})

    def to_cli_args(self, exclude: tuple[str, ...] = ("model",)) -> list[str]:
        """The flags that rebuild this config in another process (bench starts minfer.serve with
        them): only the settings that differ from their defaults."""
        out = []
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name in exclude or value == default_of(f):
                continue
            if isinstance(value, bool):
                out.append(flag(f) if value else "--no-" + flag(f)[2:])
            else:
                out += [flag(f), str(value)]
        return out
