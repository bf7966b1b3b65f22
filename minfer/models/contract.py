"""The model contract: what the engine may use of a model, and what the loader asks of a model class.

The engine never asks which model it runs. Any `CausalLM` will do: it runs one flat
forward per step and reads `.config`, `.device`, `.dtype`, `.lm_head` and `.model_dir`,
nothing else. A new architecture is a model file whose class is also an `Architecture`:
it builds from its config and names its checkpoint's tensors, and loader.from_pretrained
does the rest. tests/core/test_model_contract.py checks every class in registry.ARCHITECTURES.
"""

from __future__ import annotations

import weakref
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from ..attention.paged import PagedBatch
from ..model_config import ModelConfig


@runtime_checkable
class CausalLM(Protocol):
    """A loaded model, as the engine sees it."""

    config: ModelConfig  # vocab_size, num_layers, num_heads, num_kv_heads, head_dim, max_positions
    lm_head: torch.nn.Module  # (..., C) -> (..., V): prepare_model may swap it for a faster equivalent
    model_dir: Path | None  # the checkpoint's directory: its tokenizer and chat template are there too

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def forward(self, input_ids: torch.Tensor, paged: PagedBatch | None = None) -> torch.Tensor:
        """The engine's step, given `paged`: input_ids (N,) are every token scheduled this step, many
        sequences side by side, at positions paged.positions; returns logits (S, V) of the S rows in
        paged.sample_rows. Attention goes through attention.paged_attention, which writes the cache.
        Without `paged`, a plain batch for tutorials and parity tests: (B, T) -> (B, T, V)."""
        ...


@runtime_checkable
class Architecture(Protocol):
    """A model class that loader.from_pretrained can build: its config, and its checkpoint's names."""

    config_class: type  # with from_raw(path, config.json's contents), giving a ModelConfig

    def __call__(self, config, model_dir: Path | None = None) -> CausalLM: ...

    @staticmethod
    def checkpoint_name(key: str) -> str | None:
        """A tensor's name in the checkpoint -> its name in the model's state dict; None: not a weight."""
        ...

    @staticmethod
    def expected_shapes(config) -> dict[str, tuple[int, ...] | None]:
        """Every tensor the checkpoint must hold, under the model's names, with its shape on disk;
        None marks one to ignore if present."""
        ...

    @staticmethod
    def convert_weights(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
        """The checked tensors -> the model's (transposed, say). Tied parameters are the loader's job."""
        ...


_prepared: weakref.WeakSet = weakref.WeakSet()


def mark_prepared(model: CausalLM) -> None:
    """assembly/prepare.py's mark: the model runs in an engine now, its linears perhaps swapped for faster
    ones. Quantizing it after that would change an engine's weights behind its back (quantization/)."""
    _prepared.add(model)


def is_prepared(model: CausalLM) -> bool:
    return model in _prepared
