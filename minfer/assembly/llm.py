"""LLM: offline batch generation on top of the OnlineScheduler.

from .. import LLM, SamplingParams
llm = LLM("gpt2")
for out in llm.generate(["Hello, my name is", "The sky is"], SamplingParams(temperature=0)):
    print(out.text)
"""

from __future__ import annotations

from dataclasses import replace

from tqdm import tqdm

from ..engine.config import EngineConfig
from ..engine.generation_defaults import sampling_defaults
from ..engine.sampling_params import SamplingParams
from ..engine.outputs import RequestOutput
from .build import build_engine


class LLM:
    """`LLM(model, **settings)` or `LLM(config=EngineConfig(...))`: settings are EngineConfig's fields
    (block_size=, max_num_seqs=, dtype=, ...); given with a config, they override it."""

    def __init__(self, model: str | None = None, *, config: EngineConfig | None = None, **settings):
        if model is not None:
            settings["model"] = model
        config = replace(config or EngineConfig(), **settings)
        self.scheduler = build_engine(config)  # the model loaded and prepared, every feature attached
        self.model, self.tokenizer = self.scheduler.model, self.scheduler.tokenizer
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
