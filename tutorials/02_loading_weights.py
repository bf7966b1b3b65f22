"""Stage 02: from a checkpoint on disk (or on the Hub) to a GPT2 module with checked weights.

Opens model.safetensors without loading it, shows GPT-2's two quirks (Conv1D
weights stored [in, out], a causal-mask buffer per layer in the Hub's file),
runs minfer.models.loader.load_model_weights and checks what it did, resolves a local
directory and a Hub id, and breaks copies of the checkpoint on purpose to show
the errors a user gets.

    python tutorials/02_loading_weights.py       # MINFER_MODEL=/path to choose the checkpoint
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import model_path, section
from safetensors import safe_open

from minfer.models.config import GPT2Config
from minfer.models.gpt2 import CONV1D_WEIGHTS, GPT2, SKIPPED
from minfer.models.loader import ModelNotFoundError, load_model_weights, resolve_model_dir, safetensors_files

model_dir = Path(model_path())
config = GPT2Config.from_json(model_dir / "config.json")

section("what is in the checkpoint directory")
for file in sorted(model_dir.iterdir()):
    if file.is_file():
        print(f"  {file.name:<32} {file.stat().st_size:>13,} bytes")
files = safetensors_files(model_dir)  # model.safetensors, or the shards an index lists

section("inside model.safetensors (read lazily: a JSON header, then raw tensor bytes)")
shapes_on_disk: dict[str, list[int]] = {}
file_of: dict[str, Path] = {}  # which file holds each tensor (several, for a sharded checkpoint)
for file in files:
    with safe_open(str(file), framework="pt") as f:  # reads only the header until asked for a tensor
        for name in f.keys():
            shapes_on_disk[name] = f.get_slice(name).get_shape()
            file_of[name] = file
prefix = "transformer." if any(n.startswith("transformer.") for n in shapes_on_disk) else ""
layout = "transformers save_pretrained ('transformer.' prefix)" if prefix else "Hub (bare names)"
print(f"{len(shapes_on_disk)} tensors, {layout} layout; layer 0 and the globals:")
for name, shape in shapes_on_disk.items():
    short = name.removeprefix(prefix)
    if not short.startswith("h.") or short.startswith("h.0."):
        print(f"  {name:<40} {shape}")

C = config.n_embd
w_name = prefix + "h.0.attn.c_attn.weight"
assert shapes_on_disk[w_name] == [C, 3 * C], "GPT-2 stores its projections Conv1D-style, [in, out]"
print(f"\n{w_name} is [in={C}, out={3 * C}]: OpenAI's Conv1D computes x @ W + b, so W is stored [in, out].")

buffers = [n for n in shapes_on_disk if SKIPPED.fullmatch(n.removeprefix(prefix))]
if buffers:
    with safe_open(str(file_of[buffers[0]]), framework="pt") as f:
        mask = f.get_tensor(buffers[0])  # (1, 1, P, P)
    P = config.n_positions
    assert mask.shape == (1, 1, P, P) and torch.equal(mask[0, 0], torch.tril(torch.ones(P, P)))
    print(
        f"{buffers[0]} {list(mask.shape)} is the causal mask (a lower triangle of ones), saved as a "
        f"buffer: not a weight, so the loader skips all {len(buffers)} of them."
    )
else:
    print("no h.N.attn.bias mask buffers here (save_pretrained leaves them out; the Hub's gpt2 file has them)")

section("load_model_weights: rename, skip, check, transpose")
# Build the module on the "meta" device first: shapes, no memory, no random init. The loader
# asks its class how the checkpoint names and shapes its tensors (GPT2.checkpoint_name,
# GPT2.expected_shapes, GPT2.convert_weights) and which parameters it ties.
with torch.device("meta"):
    model = GPT2(config, model_dir=model_dir)
state = load_model_weights(model, model_dir)
expected = GPT2.expected_shapes(config)  # every tensor GPT-2 needs, with its on-disk shape
assert set(state) == set(expected), "exactly GPT-2's tensors, no mask buffers, no prefix"
assert state["lm_head.weight"] is state["wte.weight"]  # the tied LM head: one tensor under two names
assert expected.pop("lm_head.weight") is None  # tied, so a copy the checkpoint stores is not read (None)
for name, shape in expected.items():
    want = shape[::-1] if name.endswith(CONV1D_WEIGHTS) else shape  # Conv1D weights come out [out, in]
    assert tuple(state[name].shape) == want, name
print(
    f"{len(expected)} tensors (and the LM head's name for wte): the 'transformer.' prefix dropped, the mask "
    f"buffers skipped, and the {len(CONV1D_WEIGHTS)} Conv1D weights of each block transposed to nn.Linear's [out, in]"
)

with safe_open(str(file_of[w_name]), framework="pt") as f:
    raw = f.get_tensor(w_name)  # (C, 3C) as stored
assert torch.equal(state["h.0.attn.c_attn.weight"], raw.t())
x = torch.randn(3, C)  # (3, C): three token vectors
conv1d = x @ raw  # (3, C) @ (C, 3C): how OpenAI's code uses the stored matrix
linear = F.linear(x, state["h.0.attn.c_attn.weight"])  # (3, C) @ (3C, C)^T: how nn.Linear uses ours
assert torch.allclose(conv1d, linear, atol=1e-5)
print(f"x @ W_stored == F.linear(x, W_loaded): same numbers, max diff {(conv1d - linear).abs().max():.1e}")

# GPT2.from_pretrained (loader.from_pretrained) does exactly this: the meta module above, handed
# the loaded tensors, then the tied LM head tied again (assign=True made it a parameter of its own).
model.load_state_dict(state, strict=True, assign=True)  # strict: a missing or extra name is an error
assert all(p.device.type == "cpu" for p in model.parameters())
assert model.lm_head(torch.zeros(1, C)).shape == (1, config.vocab_size)  # tied to wte: no own weight
print("built on the meta device and filled with load_state_dict(strict=True, assign=True): no weight left unset")

section("resolve_model_dir: a local directory, or a Hub id")
assert resolve_model_dir(model_dir) == model_dir
print(f"a directory is used as is:        {model_dir}")
try:
    resolve_model_dir("./no/such/dir")
except FileNotFoundError as e:
    print(f"a path that is not a directory:   FileNotFoundError: {e}")
else:
    raise AssertionError("a missing local path must not be sent to the Hub")

# A Hub id goes to huggingface_hub.snapshot_download, which uses its cache when offline.
# HF_HUB_OFFLINE=1 in the environment is read once, when huggingface_hub is imported;
# flipping the parsed flag does the same for this one call.
from huggingface_hub import constants  # noqa: E402

was_offline, constants.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE, True
try:
    resolve_model_dir("minfer-tutorials/not-a-real-model")
except ModelNotFoundError as e:
    message = str(e)
finally:
    constants.HF_HUB_OFFLINE = was_offline
print(f"a Hub id, offline, not cached:    ModelNotFoundError: {message}")
assert "\n" not in message and "HF_HUB_OFFLINE" in message and "local checkpoint directory" in message

section("broken checkpoints give one clear sentence, never garbage")


def broken_copy(damage) -> Path:
    """A copy of the checkpoint that links to the original files, with one of them damaged."""
    copy = Path(tempfile.mkdtemp(prefix="minfer-broken-"))
    for file in model_dir.iterdir():
        os.symlink(file.resolve(), copy / file.name)
    damage(copy)
    return copy


def edit_config(**changes):
    def damage(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        (d / "config.json").unlink()  # replace the link, not the original
        (d / "config.json").write_text(json.dumps({**cfg, **changes}))

    return damage


def remove_weights(d: Path):
    for file in d.iterdir():
        if file.name.startswith("model") and ".safetensors" in file.name:
            file.unlink()


def truncate_weights(d: Path):
    first = d / files[0].name
    data = first.read_bytes()[: min(first.stat().st_size // 2, 1 << 20)]  # a download cut short
    first.unlink()
    first.write_bytes(data)


llama = edit_config(model_type="llama", architectures=["LlamaForCausalLM"])
cases = {  # what goes wrong: (how to break the copy, words the error must contain)
    "config.json says one more layer": (edit_config(n_layer=config.n_layer + 1), f"lacks tensor 'h.{config.n_layer}."),
    "config.json says twice the width": (edit_config(n_embd=2 * C), "but config.json implies"),
    "a truncated download": (truncate_weights, "truncated or corrupt"),
    "another architecture": (llama, "not GPT-2"),
    "no weights file": (remove_weights, "no model.safetensors"),
}
for what, (damage, expected_words) in cases.items():
    copy = broken_copy(damage)
    try:
        GPT2.from_pretrained(copy)
    except (ValueError, FileNotFoundError) as e:
        print(f"{what}:\n    {type(e).__name__}: {e}")
        assert expected_words in str(e) and "\n" not in str(e), str(e)
    else:
        raise AssertionError(f"{what}: loaded without complaint")
    finally:
        shutil.rmtree(copy)  # removes the links, never what they point to
print("\nOK: layouts, the Conv1D transpose, the checks and every error message are as the chapter says.")
