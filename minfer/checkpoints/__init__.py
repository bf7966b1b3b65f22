"""Checkpoints with random weights: config.json, model.safetensors, tokenizer.json.

The Hugging Face Hub is not always reachable (CI, air-gapped machines), so tests,
tutorials and benchmarks run on checkpoints this package writes. They have exactly
the files and tensor names of a real checkpoint (GPT-2 in either layout found in
the wild; Qwen3, Llama 3 and Llama 2 with their special tokens, chat template and
generation_config.json, Llama 2's tokenizer SentencePiece-style), so everything
downstream exercises the real loading path.

    python -m minfer.checkpoints OUT_DIR [--config gpt2|tiny|qwen3-tiny|llama-tiny|llama2-tiny|qwen3-0.6b]
                                         [--layout hub|transformers]
    (also `minfer random-model ...` and `python -m minfer.random_model ...`)

Layer: a tool beside the engine. It writes files in the checkpoint formats the models
layer reads, and imports nothing of minfer's beyond this package.
"""

from __future__ import annotations

import json
from pathlib import Path

from .files import RANDOM_MARK
from .random_gpt2 import CONFIGS, LAYOUTS, make_config, random_state_dict, write_random_gpt2
from .random_llama import LLAMA_CONFIGS, write_random_llama
from .tokenizer_training import EOS_TOKEN, train_tokenizer

__all__ = ["CONFIGS", "LAYOUTS", "LLAMA_CONFIGS", "EOS_TOKEN", "make_config", "random_state_dict",
           "train_tokenizer", "write_random_checkpoint"]
PRESETS = sorted(CONFIGS) + list(LLAMA_CONFIGS)


def write_random_checkpoint(
    out_dir: str | Path, preset: str = "tiny", layout: str = "hub", seed: int = 0, **overrides
) -> Path:
    """Write a random checkpoint of shape `preset` (GPT-2, Qwen3 or Llama) to out_dir; returns its path."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if preset in LLAMA_CONFIGS:
        write_random_llama(out, preset, seed, **overrides)
    else:
        write_random_gpt2(out, preset, layout, seed, **overrides)
    config = json.loads((out / "config.json").read_text())  # marked: random-model may write over it again
    config[RANDOM_MARK] = {"preset": preset, "seed": seed}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
