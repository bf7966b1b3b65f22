"""LLM: offline batch generation on top of the OnlineScheduler.

from .. import LLM, SamplingParams
llm = LLM("gpt2")
for out in llm.generate(["Hello, my name is", "The sky is"], SamplingParams(temperature=0)):
    print(out.text)
"""

from __future__ import annotations

from dataclasses import replace

import torch
from tqdm import tqdm

from ..cpu.features import cpu_has_native_bf16
from ..cpu.thread_share import cpu_threads_wanted
from ..models.registry import load_model
from ..quantization.checkpoint import QuantizationSpec
from ..text.tokenizer import Tokenizer
from ..engine.config import DTYPES, EngineConfig
from ..engine.generation_defaults import sampling_defaults
from ..engine.sampling import SamplingParams
from ..engine.scheduler import OnlineScheduler
from ..engine.sequence import RequestOutput


def resolve_dtype(dtype: torch.dtype | str, device: torch.device = torch.device("cpu")) -> torch.dtype:
    """A torch dtype from a dtype or a name; "auto" picks bf16 where it is fast, else fp32."""
    if isinstance(dtype, torch.dtype):
        return dtype
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
    """Give torch every core this process may use, unless told otherwise (cpu_threads_wanted;
    torch obeys OMP_NUM_THREADS at import, and minfer used to override it). Decode is memory-bound
    and prefill compute-bound, both want every core. Call it before loading a model: the fp32 LM head
    is sliced once per thread at load time. Returns the thread count."""
    num_threads = cpu_threads_wanted(num_threads)
    torch.set_num_threads(num_threads)
    return num_threads


def quantization_spec(config: EngineConfig) -> QuantizationSpec | None:
    """What load_model needs to quantize as it loads (the float model never sits in memory whole)."""
    if config.quantization is None:
        return None
    return QuantizationSpec(config.quantization, config.quantization_group_size, config.quantize_lm_head)


class LLM:
    """`LLM(model, **settings)` or `LLM(config=EngineConfig(...))`: settings are EngineConfig's fields
    (block_size=, max_num_seqs=, dtype=, ...); given with a config, they override it."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **settings):
        if model is not None:
            settings["model"] = model
        config = replace(config or EngineConfig(), **settings)
        device = torch.device(config.device)
        check_device(device)
        if device.type == "cpu":
            set_cpu_threads(config.num_threads)
        dtype = resolve_dtype(config.dtype, device)
        self.model = load_model(config.model, device=device, dtype=dtype, quantization=quantization_spec(config))
        self.tokenizer = Tokenizer.from_dir(self.model.model_dir)
        self.scheduler = OnlineScheduler(self.model, self.tokenizer, config)  # its engine_config: what runs
        self.sampling_defaults, _ = sampling_defaults(self.model.model_dir, config.generation_config)

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() samples with when given no SamplingParams: the checkpoint's
        generation_config.json settings under --generation-config auto (the default), as in vLLM."""
        return SamplingParams(**self.sampling_defaults)

    def generate(
        self,
        prompts: list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion, all together; results (text, token_ids, prompt_token_ids,
        finish_reason, ...) come back in prompt order: with SamplingParams(n=...), n per prompt, one per
        choice, in `index` order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # one prompt given bare
        if sampling_params is None or isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params or self.get_default_sampling_params()] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                if isinstance(prompt, str):
                    ids.append(self.scheduler.add_request(prompt, sampling_params=params))
                else:
                    ids.append(self.scheduler.add_request(prompt_token_ids=prompt, sampling_params=params))
            show_bar = use_tqdm and len(ids) > 1  # one prompt: nothing to count
            with tqdm(total=len(ids), desc="generate", unit="req", disable=not show_bar) as bar:
                for _ in self.scheduler.steps():
                    bar.update(len(self.scheduler.pop_finished_ids()))
            return [out for i in ids for out in self.scheduler.pop_responses(i)]
        finally:  # an error (or Ctrl-C) must not leave requests holding KV blocks
            for i in ids:
                self.scheduler.discard_request(i)

    def stats(self) -> dict:
        return self.scheduler.stats()

    def close(self) -> None:
        """Release the engine's CUDA graphs and their memory (vLLM frees them at shutdown). The model and its
        cache go with the last reference to this LLM, as any tensor does."""
        self.scheduler.close()
