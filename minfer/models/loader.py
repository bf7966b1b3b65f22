"""Find a checkpoint (local directory or Hugging Face Hub repo) and load its safetensors weights.

GPT-2 checkpoints come in two layouts:
- the Hub's openai-community/gpt2 file: names like `h.0.attn.c_attn.weight`, plus a
  causal-mask buffer `h.N.attn.bias` per layer (not a weight: skipped);
- transformers' `save_pretrained` output: the same names prefixed with `transformer.`.
Neither stores `lm_head.weight` as a separate matrix (it is tied to `wte.weight`).
GPT-2's four projection matrices are stored Conv1D-style as [in, out]; minfer's
nn.Linear layers want [out, in], so they are transposed once here.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import SafetensorError, safe_open

from .config import GPT2Config

# Short names users type, mapped to the Hub repos that hold them today.
HUB_ALIASES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}
# Only these files are fetched from the Hub (a GPT-2 repo also holds TF, Flax, ONNX, ...).
HUB_FILES = [
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "model-*.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
]
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
SKIPPED = re.compile(r"h\.\d+\.attn\.(bias|masked_bias)$")  # causal-mask buffers, not weights


class ModelNotFoundError(OSError):
    """The model could not be found locally nor fetched from the Hub."""


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A local directory is used as is; anything else is a Hub repo id, fetched into the HF cache."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    name = str(name_or_path)
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") > 1:
        raise FileNotFoundError(f"model path {name!r} is not a directory")
    repo_id = HUB_ALIASES.get(name, name)
    try:
        from huggingface_hub import snapshot_download  # shows a tqdm progress bar per file

        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILES))
    except Exception as e:  # offline, unknown repo, gated repo, network failure: all one message
        from huggingface_hub import constants

        if constants.HF_HUB_OFFLINE:
            reason = "HF_HUB_OFFLINE is set"
        else:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelNotFoundError(
            f"could not get model {name!r} from the Hugging Face Hub and found no cached copy "
            f"({reason}); pass a local checkpoint directory instead, "
            f"e.g. one written by `python -m minfer.random_model DIR`"
        ) from None


def expected_shapes(config: GPT2Config) -> dict[str, tuple[int, ...]]:
    """Every tensor a GPT-2 checkpoint must hold, with its shape as stored on disk."""
    C, F, V, P = config.n_embd, config.mlp_dim, config.vocab_size, config.n_positions
    shapes = {"wte.weight": (V, C), "wpe.weight": (P, C), "ln_f.weight": (C,), "ln_f.bias": (C,)}
    for i in range(config.n_layer):
        p = f"h.{i}."
        shapes.update(
            {
                p + "ln_1.weight": (C,),
                p + "ln_1.bias": (C,),
                p + "attn.c_attn.weight": (C, 3 * C),
                p + "attn.c_attn.bias": (3 * C,),
                p + "attn.c_proj.weight": (C, C),
                p + "attn.c_proj.bias": (C,),
                p + "ln_2.weight": (C,),
                p + "ln_2.bias": (C,),
                p + "mlp.c_fc.weight": (C, F),
                p + "mlp.c_fc.bias": (F,),
                p + "mlp.c_proj.weight": (F, C),
                p + "mlp.c_proj.bias": (C,),
            }
        )
    return shapes


def safetensors_files(model_dir: Path) -> list[Path]:
    """model.safetensors, or the shards listed by model.safetensors.index.json."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e!r}") from None
        shards = [model_dir / name for name in dict.fromkeys(weight_map.values())]
        for shard in shards:
            if not shard.is_file():
                raise FileNotFoundError(f"{index} lists shard {shard.name}, which is missing from {model_dir}")
        return shards
    raise FileNotFoundError(
        f"no model.safetensors (or model.safetensors.index.json) in {model_dir}; minfer loads safetensors weights only"
    )


def read_checked_weights(
    model_dir: str | Path,
    expected: dict[str, tuple[int, ...] | None],
    rename: Callable[[str], str | None],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    optional: frozenset[str] = frozenset(),
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, under the model's names (`rename`: None skips a non-weight),
    checked against `expected` (name -> shape; None: ignored if present). Names in `optional` are
    read and checked if present, and not required. A missing, unexpected or mis-shaped tensor
    raises ValueError naming it: a partial load would run and produce garbage."""
    model_dir = Path(model_dir)
    state: dict[str, torch.Tensor] = {}
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    name = rename(key)
                    if name is None or (name in expected and expected[name] is None):
                        continue
                    if name not in expected:
                        raise ValueError(f"{file.name} holds unexpected tensor {key!r}: not part of this model")
                    tensor = f.get_slice(key)
                    if tuple(tensor.get_shape()) != expected[name]:
                        raise ValueError(
                            f"tensor {key!r} in {file.name} has shape {list(tensor.get_shape())}, "
                            f"but config.json implies {list(expected[name])}"
                        )
                    state[name] = f.get_tensor(key).to(device=device, dtype=dtype).contiguous()
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    missing = [n for n, shape in expected.items() if shape is not None and n not in state and n not in optional]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint in {model_dir} lacks tensor {missing[0]!r}{more}")
    return state


def load_model_weights(
    model_dir: str | Path, config: GPT2Config, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """Read, check and convert every weight; returns a state dict for minfer's GPT2 module.

    A missing, unexpected or mis-shaped tensor raises ValueError naming it:
    a partial load would run and quietly produce garbage.
    """

    def rename(key: str) -> str | None:
        name = key.removeprefix("transformer.")
        return None if SKIPPED.fullmatch(name) else name  # the causal-mask buffers are no weights

    # Some exports store the tied LM head as well: read it to check that it is the embedding.
    expected = expected_shapes(config) | {"lm_head.weight": (config.vocab_size, config.n_embd)}
    state = read_checked_weights(model_dir, expected, rename, device, dtype, optional=frozenset({"lm_head.weight"}))
    for name in state:
        if name.endswith(CONV1D_WEIGHTS):
            state[name] = state[name].t().contiguous()  # Conv1D [in, out] -> Linear [out, in]
    lm_head = state.pop("lm_head.weight", None)
    if lm_head is not None and not torch.equal(lm_head, state["wte.weight"]):
        raise ValueError("lm_head.weight differs from wte.weight; GPT-2's LM head must be tied to the embedding")
    state["lm_head.weight"] = state["wte.weight"]  # tied: one tensor under both names
    return state
