"""Find a checkpoint (local directory or Hugging Face Hub repo) and load its safetensors weights.

One loader for every architecture: `from_pretrained(model_class, name_or_path)` builds the
model its config.json describes and fills it with the checkpoint's tensors, read, renamed,
checked and converted as the model class says (its checkpoint name mapping: `checkpoint_name`,
`expected_shapes`, `convert_weights`; contract.Architecture). Each
architecture's names and quirks live in its own file (gpt2.py, llama.py), none here.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Protocol

import torch
from safetensors import SafetensorError, safe_open

from .config import read_config_json

if TYPE_CHECKING:
    from .contract import Architecture, CausalLM

log = logging.getLogger("minfer")


class TensorTaker(Protocol):
    """Keeps some weights itself as they are read (quantization/checkpoint.py's StreamingQuantizer)."""

    def wants(self, name: str) -> bool: ...

    def take(self, name: str, tensor: torch.Tensor) -> bool: ...  # True: it kept the tensor (as stored)


class WeightLoader(Protocol):
    """A way to load a checkpoint's weights other than as they are stored, handed to from_pretrained
    (quantization/checkpoint.py's QuantizedWeights: quantized as they load, or a quantized checkpoint)."""

    def loads(self, raw_config: dict, config_path: Path) -> bool:
        """Whether it loads this checkpoint (config.json's contents), rather than the plain loader."""
        ...

    def load(self, model: torch.nn.Module, model_dir: Path, device, dtype: torch.dtype) -> CausalLM:
        """`model`, built on the meta device, filled with the checkpoint's weights."""
        ...

# Short names users type, mapped to the Hub repos that hold them today.
HUB_ALIASES = {
    "gpt2": "openai-community/gpt2",
    "gpt2-medium": "openai-community/gpt2-medium",
    "gpt2-large": "openai-community/gpt2-large",
    "gpt2-xl": "openai-community/gpt2-xl",
    "distilgpt2": "distilbert/distilgpt2",
}
# Models shipped inside the package (models/builtin/), found by name before anything else, with no network.
# minfer-tiny-draft is minfer-tiny's draft model for speculative decoding (same tokenizer, a few times smaller);
# minfer-tiny-llama (and its draft) the same text and tokenizer in Llama's shape, which learns to copy from
# its context: the model speculative decoding is measured on.
BUILTIN_MODELS = {
    name: Path(__file__).parent / "builtin" / name
    for name in ("minfer-tiny", "minfer-tiny-draft", "minfer-tiny-llama", "minfer-tiny-llama-draft")
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


class ModelNotFoundError(OSError):
    """The model could not be found locally nor fetched from the Hub."""


def resolve_model_dir(name_or_path: str | os.PathLike) -> Path:
    """A built-in name (BUILTIN_MODELS) is the shipped directory; a local directory is used as is;
    anything else is a Hub repo id, fetched into the HF cache."""
    if str(name_or_path) in BUILTIN_MODELS:
        return BUILTIN_MODELS[str(name_or_path)]
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
            f"({reason}); offline, use the model shipped with minfer: --model minfer-tiny (or a local "
            "checkpoint directory)"
        ) from None


INDEX = "model.safetensors.index.json"  # a sharded checkpoint's {tensor name: shard file}


def safetensors_files(model_dir: Path) -> list[Path]:
    """model.safetensors, or the shards listed by model.safetensors.index.json."""
    single, index = model_dir / "model.safetensors", model_dir / INDEX
    if single.is_file():
        return [single]
    if index.is_file():
        shards = [model_dir / name for name in dict.fromkeys(read_weight_map(index).values())]
        for shard in shards:
            if not shard.is_file():
                raise FileNotFoundError(f"{index} lists shard {shard.name}, which is missing from {model_dir}")
        return shards
    raise FileNotFoundError(
        f"no model.safetensors (or model.safetensors.index.json) in {model_dir}; minfer loads safetensors weights only"
    )


def read_weight_map(index: Path) -> dict[str, str]:
    """The index's weight_map: which shard file holds each tensor."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{index} is not a valid safetensors index: {e!r}") from None
    if not isinstance(weight_map, dict) or not all(isinstance(file, str) and file for file in weight_map.values()):
        raise ValueError(f"{index} is not a valid safetensors index: "
                         "its weight_map must map tensor names to shard file names")
    return weight_map


def shard_contents(model_dir: Path) -> dict[str, set[str]]:
    """{shard file name: the tensors the index places in it}; {} for a checkpoint of one file."""
    if (model_dir / "model.safetensors").is_file() or not (model_dir / INDEX).is_file():
        return {}
    contents: dict[str, set[str]] = {}
    for key, file in read_weight_map(model_dir / INDEX).items():
        contents.setdefault(file, set()).add(key)
    return contents


def check_shard(file: Path, keys: list[str], placed: set[str], read_from: dict[str, str]) -> None:
    """A shard holds every tensor the index places in it (`placed`), and none that another file held already
    (`read_from`: {tensor: file}): a second copy would replace the first silently, whichever file came last."""
    for key in keys:
        if key in read_from:
            raise ValueError(f"tensor {key!r} is in both {read_from[key]} and {file.name}: "
                             "a checkpoint holds each tensor once")
        read_from[key] = file.name
    absent = placed - set(keys)
    if absent:
        raise ValueError(f"{INDEX} places tensor {min(absent)!r} in {file.name}, which does not hold it")


FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}  # safetensors' names of the dtypes a weight may be stored in


def read_checked_weights(
    model_dir: str | Path,
    expected: dict[str, tuple[int, ...] | None],
    rename: Callable[[str], str | None],
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    take: Callable[[str, torch.Tensor], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint, under the model's names (`rename`: None skips a non-weight),
    checked against `expected` (name -> shape; None: ignored if present). A missing, unexpected or
    mis-shaped tensor raises ValueError naming it: a partial load would run and produce garbage.
    `take(name, tensor)` may keep a tensor itself instead (True): quantizing while loading, one at a time, each
    tensor in the precision it is stored in, on the CPU."""
    model_dir = Path(model_dir)
    state: dict[str, torch.Tensor] = {}
    taken: set[str] = set()
    placed, read_from = shard_contents(model_dir), {}
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                check_shard(file, f.keys(), placed.get(file.name, set()), read_from)
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
                    if tensor.get_dtype() not in FLOAT_DTYPES:  # cast, integers would load as garbage weights
                        raise ValueError(f"tensor {key!r} in {file.name} holds {tensor.get_dtype()} values, not "
                                         "floats: a checkpoint quantized by another tool, which minfer does not read")
                    tensor = f.get_tensor(key) if take is None else read_alone(file, key)
                    if take is not None and take(name, tensor):  # as stored: a copy in `dtype` rounds it twice
                        taken.add(name)
                    else:
                        state[name] = tensor.to(device=device, dtype=dtype).contiguous()
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    missing = [n for n, shape in expected.items()
               if shape is not None and n not in state and n not in taken]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"checkpoint in {model_dir} lacks tensor {missing[0]!r}{more}")
    return state


def read_alone(file: Path, key: str) -> torch.Tensor:
    """One tensor through a mapping of its own, closed at once. Quantizing while loading keeps only
    the quantized copy; but every page of the file read through the long-lived mapping above would
    stay mapped, and counted in RSS until the loop ends (Qwen3-0.6B int8: 2.0 GB peak without this,
    0.87 GB with it and malloc.py's setting; either alone, ~2 GB)."""
    with safe_open(str(file), framework="pt", device="cpu") as f:
        return f.get_tensor(key)


def load_model_weights(
    model: CausalLM,
    model_dir: str | Path,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    quantizer: TensorTaker | None = None,
) -> dict[str, torch.Tensor]:
    """Every weight `model` needs (built on the meta device, say), read from the checkpoint in model_dir
    and converted as its class says: a state dict for model.load_state_dict(strict=True, assign=True).
    A tied parameter (an LM head that is the token embedding) gets its owner's tensor under both names.

    A missing, unexpected or mis-shaped tensor raises ValueError naming it:
    a partial load would run and quietly produce garbage.
    """
    arch: Architecture = type(model)
    expected = arch.expected_shapes(model.config)
    tied = tied_parameters(model)

    def take(name: str, tensor: torch.Tensor) -> bool:  # with a quantizer: each weight quantized as it is read,
        if quantizer.wants(tied.get(name, "")):  # its float copy never joining the state
            return True  # a stored copy of a tied weight, quantized from its owner's tensor
        if not quantizer.wants(name):
            return False
        return quantizer.take(name, arch.convert_weights({name: tensor}, model.config)[name])

    state = read_checked_weights(model_dir, expected, arch.checkpoint_name, device, dtype,
                                 take if quantizer is not None else None)
    state = arch.convert_weights(state, model.config)
    for alias, owner in tied.items():
        if owner in state:
            state[alias] = state[owner]  # one tensor under both names
    return state


def tied_parameters(model: torch.nn.Module) -> dict[str, str]:
    """{alias: owner} for every parameter that two modules share; the owner is the name it was registered
    under first (GPT-2: {"lm_head.weight": "wte.weight"}, the LM head tied to the embedding)."""
    owners: dict[int, str] = {}
    tied = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in owners:
            tied[name] = owners[id(param)]
        else:
            owners[id(param)] = name
    return tied


def retie(model: torch.nn.Module, tied: dict[str, str]) -> None:
    """After load_state_dict(assign=True), which gives each name a parameter of its own: every alias in
    `tied` ({alias: owner}, from tied_parameters) is its owner's parameter again."""
    for alias, owner in tied.items():
        module, _, name = alias.rpartition(".")
        setattr(model.get_submodule(module), name, model.get_parameter(owner))


def from_pretrained(
    model_class: Architecture,
    name_or_path: str | os.PathLike,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    weights: WeightLoader | None = None,
    config_json: tuple[Path, dict] | None = None,
) -> CausalLM:
    """Build `model_class` from a local checkpoint directory or a Hugging Face Hub repo id. `weights`, if
    given and it says so, loads the weights its own way (quantizing them as they are read, say).
    `config_json`: read_config_json's (path, contents) of its config.json, where the caller read it already."""
    model_dir = resolve_model_dir(name_or_path)
    config_path, raw = config_json or read_config_json(model_dir)
    config = untied_where_stored_apart(model_class, model_class.config_class.from_raw(config_path, raw), model_dir)
    with torch.device("meta"):  # no memory and no random init for weights about to be replaced
        model = model_class(config, model_dir=model_dir)
    if weights is not None and weights.loads(raw, config_path):
        return weights.load(model, model_dir, device, dtype)
    if raw.get("quantization_config") is not None:
        raise ValueError(
            f"{config_path} describes a quantized checkpoint: load it through minfer's engine (LLM, build_engine), "
            "which reads quantized weights"
        )
    tied = tied_parameters(model)
    model.load_state_dict(load_model_weights(model, model_dir, device, dtype), strict=True, assign=True)
    retie(model, tied)
    return model.to(device).eval()  # .to: buffers computed at construction (RoPE's) join the weights


def untied_where_stored_apart(model_class: Architecture, config, model_dir: Path):
    """`config`, untied if config.json ties the LM head to the embedding (tie_word_embeddings) but the checkpoint
    stores both, with different values: transformers then keeps each its own (with a warning), and so must we,
    or the logits differ from its."""
    if not getattr(config, "tie_word_embeddings", False):
        return config
    with torch.device("meta"):
        tied = tied_parameters(model_class(config))
    where = stored_where(model_dir, model_class.checkpoint_name, set(tied) | set(tied.values()))
    for alias, owner in tied.items():
        if alias in where and owner in where and not equal_values(read_alone(*where[alias]), read_alone(*where[owner])):
            log.warning("minfer: %s ties %s to %s (tie_word_embeddings), but the checkpoint stores %s, and it differs "
                        "from %s: each keeps its own, as in transformers (set tie_word_embeddings to false to say so)",
                        model_dir / "config.json", alias, owner, alias, owner)
            return replace(config, tie_word_embeddings=False)
    return config


def stored_where(model_dir: Path, rename: Callable[[str], str | None], names: set[str]) -> dict[str, tuple[Path, str]]:
    """Where the checkpoint stores the tensors of `names` (the model's names): their file and key, read from the
    files' headers only (a tied model usually stores just the embedding, which then is never read here)."""
    found = {}
    for file in safetensors_files(model_dir):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                found.update({rename(key): (file, key) for key in f.keys() if rename(key) in names})
        except SafetensorError as e:
            raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    return found


def equal_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The same shape and values, whatever dtype each is stored in."""
    return a.shape == b.shape and torch.equal(a, b.to(a.dtype))
