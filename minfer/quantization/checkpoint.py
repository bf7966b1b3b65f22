"""Quantized models on disk and in the loader: quantize tensor by tensor while loading, save, load back.

Streaming (`StreamingQuantizer`): the loader hands over each tensor as it reads it; a weight of a
linear to be quantized is quantized there and then and its float copy dropped, so peak memory is the
quantized model plus one tensor in full precision, not the whole float model.

The format `minfer quantize` writes: the source's config.json plus a `quantization_config`
({"quant_method": "minfer", "format": "int8" | "int4", "group_size", "quantize_lm_head"}), and one
model.safetensors under the model's own module names: for each quantized linear `NAME.qweight`
and `NAME.scales` (int8: (out, in) int8 and (out,) fp32) or `NAME.qweight` and
`NAME.scales_and_zeros` (int4: (out, in'/2) uint8 nibbles and (in'/G, out, 2) fp32), its
`NAME.bias` if any, and every other tensor as it is. A tied embedding is its LM head's matrix,
stored once. Any other `quantization_config` (GPTQ, AWQ, ...) is refused, saying what minfer runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from ..cpu.malloc import freed_memory_returned
from ..engine.config import GROUP_SIZES
from ..models.loader import load_model_weights, retie, tied_parameters
from .embedding import QuantizedEmbedding
from .int4 import DEFAULT_GROUP_SIZE, Int4Linear, quantize_int4
from .int8 import Int8Linear, quantize_int8
from .linear import QuantizedLinear
from .transform import check_quantization, find_token_embedding, quantization_of

FORMAT_NAME = "minfer"


@dataclass(frozen=True)
class QuantizationSpec:
    method: str  # "int8" or "int4"
    group_size: int | None = None  # int4 only (None: the default)
    quantize_lm_head: bool = True

    def __post_init__(self):
        check_quantization(self.method, self.group_size)

    def to_config(self) -> dict:
        return {"quant_method": FORMAT_NAME, "format": self.method, "group_size": self.group_size,
                "quantize_lm_head": self.quantize_lm_head}


def spec_from_config(raw: dict, path: Path) -> QuantizationSpec | None:
    """The spec a config.json's `quantization_config` describes; None for a full-precision checkpoint.
    ValueError naming what is supported for a format minfer cannot read."""
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    method = qc.get("quant_method") if isinstance(qc, dict) else None
    if method != FORMAT_NAME or qc.get("format") not in ("int8", "int4"):
        raise ValueError(
            f"{path} describes a checkpoint quantized as {method or qc!r}, which minfer cannot load. minfer runs "
            "full-precision checkpoints (quantized as they load with --quantization int8 or int4) and the int8/int4 "
            "checkpoints `minfer quantize SRC DST --quantization int8` writes; GPTQ, AWQ and the like are not supported"
        )
    method, group_size, lm_head = qc["format"], qc.get("group_size"), qc.get("quantize_lm_head", True)
    if group_size is not None and (method == "int8" or type(group_size) is not int or group_size not in GROUP_SIZES):
        written = "none (null)" if method == "int8" else ", ".join(map(str, GROUP_SIZES))
        raise ValueError(f"{path}: quantization_config's group_size is {group_size!r}; an {method} checkpoint minfer "
                         f"writes has {written}")
    if not isinstance(lm_head, bool):
        raise ValueError(f"{path}: quantization_config's quantize_lm_head is {lm_head!r}, not true or false")
    return QuantizationSpec(method, group_size, lm_head)


def quantize_weight(weight: torch.Tensor, spec: QuantizationSpec) -> dict[str, torch.Tensor]:
    """A float (out, in) weight -> its stored tensors ({"qweight", "scales"} or {"qweight", "scales_and_zeros"})."""
    if spec.method == "int8":
        q, scales = quantize_int8(weight)
        return {"qweight": q, "scales": scales}
    nibbles, sz = quantize_int4(weight, spec.group_size or 64)
    return {"qweight": nibbles, "scales_and_zeros": sz}


def check_stored(name: str, stored: dict[str, torch.Tensor], spec: QuantizationSpec, out_features: int,
                 in_features: int):
    """ValueError naming `name` unless `stored` holds the tensors, dtypes and shapes `spec` makes for an
    (out, in) weight: a damaged checkpoint must not load and run garbage."""
    if spec.method == "int8":
        want = {"qweight": (torch.int8, (out_features, in_features)), "scales": (torch.float32, (out_features,))}
    else:
        group = spec.group_size or 64
        padded = -(-in_features // group) * group
        want = {"qweight": (torch.uint8, (out_features, padded // 2)),
                "scales_and_zeros": (torch.float32, (padded // group, out_features, 2))}
    for leaf, (dtype, shape) in want.items():
        tensor = stored.get(leaf)
        if tensor is None:
            raise ValueError(f"the checkpoint lacks {name.removesuffix('.weight')}.{leaf}")
        if tensor.dtype != dtype or tuple(tensor.shape) != shape:
            raise ValueError(f"{name.removesuffix('.weight')}.{leaf} is {tensor.dtype} {list(tensor.shape)}, "
                             f"expected {dtype} {list(shape)} for {spec.method}")


def build_linear(stored: dict[str, torch.Tensor], spec: QuantizationSpec, in_features: int, bias) -> QuantizedLinear:
    if spec.method == "int8":
        return Int8Linear(stored["qweight"], stored["scales"], bias)
    return Int4Linear(stored["qweight"], stored["scales_and_zeros"], in_features, bias)


def quantized_targets(model: nn.Module, spec: QuantizationSpec) -> dict[str, nn.Module]:
    """{weight name: module} of every weight `spec` quantizes, for `model` as built (on the meta device):
    the linears, and unless the head stays full precision, the head (or the embedding it is tied to)."""
    head = getattr(model, "lm_head", None)
    targets = {f"{name}.weight": m for name, m in model.named_modules() if type(m) is nn.Linear and m is not head}
    if spec.quantize_lm_head and type(head) is nn.Linear:
        embedding = find_token_embedding(model, head)
        if embedding is not None and embedding[2].weight is head.weight:  # tied: one matrix, the owner's name
            owner = next(n for n, p in model.named_parameters() if p is head.weight)
            targets[owner] = head
        else:
            targets["lm_head.weight"] = head
            if embedding is not None:
                targets[next(n for n, p in model.named_parameters() if p is embedding[2].weight)] = embedding[2]
    return targets


class StreamingQuantizer:
    """Quantizes a model's weights as the loader reads them (`take`), then builds the quantized
    modules into the model (`install`)."""

    def __init__(self, model: nn.Module, spec: QuantizationSpec):
        self.spec = spec
        self.targets = quantized_targets(model, spec)
        self.quantized: dict[str, dict[str, torch.Tensor]] = {}

    def wants(self, name: str) -> bool:
        return name in self.targets

    def take(self, name: str, tensor: torch.Tensor) -> bool:
        """Quantize `tensor` if it is a weight to quantize (True: the loader drops its float copy). It comes as the
        checkpoint stores it, whatever the model's dtype: an fp32 weight is not rounded to bf16 before its int8 or
        int4 rounding, so the quantized weights do not depend on --dtype (a `minfer quantize` checkpoint holds them)."""
        if name not in self.targets:
            return False
        self.quantized[name] = quantize_weight(tensor, self.spec)
        return True

    def install(self, model: nn.Module, state: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
        """Swap the quantized modules into `model`; biases are taken from `state`."""
        install_quantized(model, self.quantized, state, self.spec, dtype)


def install_quantized(model, quantized: dict[str, dict], state: dict, spec: QuantizationSpec, dtype) -> None:
    """Build each quantized module from its stored tensors (`quantized`: weight name -> tensors) and set
    it in `model`; tied embeddings read their head's. `state` gives the biases (and loses them)."""
    head = getattr(model, "lm_head", None)
    embedding = find_token_embedding(model, head if type(head) is nn.Linear else None)
    tied = embedding is not None and type(head) is nn.Linear and embedding[2].weight is head.weight
    built: dict[int, QuantizedLinear] = {}
    targets = quantized_targets(model, spec)
    unexpected = sorted(set(quantized) - set(targets))  # a head stored apart from the embedding its config ties, say
    if unexpected:
        raise ValueError(f"the checkpoint holds quantized tensors of {unexpected[0]!r}, which this model does not have")
    for weight_name, module in targets.items():
        if weight_name not in quantized:
            raise ValueError(f"the checkpoint lacks the quantized tensors of {weight_name!r}")
        module_name = weight_name.removesuffix(".weight")
        bias = state.pop(f"{module_name}.bias", None) if isinstance(module, nn.Linear) else None
        in_features = module.in_features if isinstance(module, nn.Linear) else module.embedding_dim
        out_features = module.out_features if isinstance(module, nn.Linear) else module.num_embeddings
        check_stored(weight_name, quantized[weight_name], spec, out_features, in_features)
        built[id(module)] = build_linear(quantized[weight_name], spec, in_features, bias)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in built:
                if isinstance(child, nn.Embedding):
                    setattr(parent, name, QuantizedEmbedding(built[id(child)], dtype))
                else:
                    setattr(parent, name, built[id(child)])
    if tied and id(head) in built:
        parent, name, _ = embedding
        setattr(parent, name, QuantizedEmbedding(built[id(head)], dtype))


def save_quantized(model: nn.Module, source_dir: str | Path, out_dir: str | Path, spec: QuantizationSpec) -> Path:
    """Write quantized `model` (loaded from source_dir) to out_dir: model.safetensors, config.json with its
    quantization_config, and the source's tokenizer files."""
    if quantization_of(model) != spec.method:
        raise ValueError(f"the model is not quantized to {spec.method}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, module in model.named_modules():  # an embedding comes before the head tied to it
        linear = module.table if isinstance(module, QuantizedEmbedding) else module
        if isinstance(linear, QuantizedLinear) and id(linear) not in seen:
            seen.add(id(linear))  # a tied head: stored once, under the embedding's name (the weight's owner)
            first, second = linear.stored()
            tensors[f"{name}.qweight"] = first.contiguous()
            tensors[f"{name}.{'scales' if spec.method == 'int8' else 'scales_and_zeros'}"] = second.contiguous()
            if linear.bias is not None:
                tensors[f"{name}.bias"] = linear.bias.detach().contiguous()
    quantized_params = {id(p) for m in model.modules() if isinstance(m, QuantizedLinear) for p in m.parameters()}
    for name, param in model.named_parameters():
        if id(param) not in quantized_params:
            tensors[name] = param.detach().contiguous()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt", "quantization": spec.method})
    source = Path(source_dir)
    raw = json.loads((source / "config.json").read_text(encoding="utf-8"))
    raw["quantization_config"] = spec.to_config()
    if raw.get("tie_word_embeddings") and not getattr(model.config, "tie_word_embeddings", True):
        raw["tie_word_embeddings"] = False  # the loader kept a head stored apart from the embedding (loader.py)
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    for file in source.iterdir():
        if file.name.startswith(("tokenizer", "vocab", "merges", "generation_config", "special_tokens")):
            (out / file.name).write_bytes(file.read_bytes())
    return out


def read_quantized_state(model_dir: Path, dtype: torch.dtype) -> tuple[dict[str, dict], dict[str, torch.Tensor]]:
    """({weight name: stored quantized tensors}, {name: float tensor in `dtype`}) from a checkpoint
    `minfer quantize` wrote; ValueError for a file that cannot be read."""
    file = model_dir / "model.safetensors"
    quantized: dict[str, dict] = {}
    state: dict[str, torch.Tensor] = {}
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors file, not a dict)
                module, _, leaf = key.rpartition(".")
                tensor = f.get_tensor(key)
                if leaf in ("qweight", "scales", "scales_and_zeros"):
                    quantized.setdefault(f"{module}.weight", {})[leaf] = tensor
                elif not tensor.is_floating_point():  # cast, integers would load as garbage weights
                    raise ValueError(f"{file} holds {key!r} as {tensor.dtype}, not floats: a full-precision tensor "
                                     "of the model's (a damaged checkpoint?)")
                else:
                    state[key] = tensor.to(dtype)
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file} is not a readable safetensors file (truncated or corrupt?): {e}") from None
    return quantized, state


class QuantizedWeights:
    """The loader's way to quantized weights (models/loader.py: WeightLoader): a checkpoint `minfer quantize`
    wrote loads quantized whatever `spec` says; a float one is quantized tensor by tensor as it is read,
    when `spec` asks (the float model never sits in memory whole)."""

    def __init__(self, spec: QuantizationSpec | None = None):
        self.spec = spec
        self.stored: QuantizationSpec | None = None

    def loads(self, raw_config: dict, config_path: Path) -> bool:
        self.stored = spec_from_config(raw_config, config_path)  # refuses GPTQ, AWQ, ... clearly
        if self.stored is not None and self.spec is not None:
            self._check_asked(config_path.parent)
        return self.stored is not None or self.spec is not None

    def _check_asked(self, where: Path) -> None:
        """The weights are quantized already: a setting asked for that they were not written with cannot apply.
        Only what differs from a default is judged (quantize_lm_head True, group_size None: given or not)."""
        stored, asked = self.stored, self.spec
        if stored.method != asked.method:
            raise ValueError(f"{where} holds {stored.method} weights; it cannot be loaded as {asked.method}")
        stored_groups = stored.group_size or DEFAULT_GROUP_SIZE
        if asked.group_size is not None and asked.group_size != stored_groups:
            raise ValueError(f"{where} holds int4 weights in groups of {stored_groups}; it cannot be loaded with "
                             f"groups of {asked.group_size} (quantize its full-precision checkpoint again)")
        if stored.quantize_lm_head and not asked.quantize_lm_head:
            raise ValueError(f"{where} holds its LM head quantized; it cannot be loaded with --no-quantize-lm-head "
                             "(quantize its full-precision checkpoint with --no-quantize-lm-head)")

    def load(self, model: nn.Module, model_dir: Path, device, dtype: torch.dtype) -> nn.Module:
        """`model` (on the meta device) filled from a quantized checkpoint, or from a float one quantized
        tensor by tensor. Every weight must be there: nothing half-loaded."""
        if torch.device(device).type != "cpu":
            raise ValueError(f"quantized weights run on the CPU only for now, not on {device}")
        with freed_memory_returned():  # temporaries (float weights, int4's int32 copies) go back to the OS: malloc.py
            if self.stored is not None:
                quantized, state = read_quantized_state(model_dir, dtype)
                install_quantized(model, quantized, state, self.stored, dtype)
            else:
                quantizer = StreamingQuantizer(model, self.spec)
                state = load_model_weights(model, model_dir, "cpu", dtype, quantizer)
                quantizer.install(model, state, dtype)
        # A head kept in full precision may still be tied to the embedding: load the owner, then tie again.
        tied = tied_parameters(model)
        for alias in tied:
            state.pop(alias, None)  # the owner's tensor, under a second name
        wanted = {n for n, p in model.named_parameters() if p.is_meta}  # one name per shared parameter
        missing, unexpected = sorted(wanted - set(state)), sorted(set(state) - wanted)
        if missing or unexpected:
            what = f"lacks tensor {missing[0]!r}" if missing else f"holds unexpected tensor {unexpected[0]!r}"
            raise ValueError(f"quantized checkpoint in {model_dir} {what}")
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(model.get_parameter(name).shape):
                raise ValueError(f"tensor {name!r} in {model_dir} has shape {list(tensor.shape)}, expected "
                                 f"{list(model.get_parameter(name).shape)}")
        model.load_state_dict(state, strict=False, assign=True)
        retie(model, tied)
        return model.to("cpu").eval()
