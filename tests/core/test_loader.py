"""Loading checkpoints: both layouts, shards, and a clear one-line error for every bad input."""

import json
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from script_forks import run_python

from minfer.models.config import GPT2Config
from minfer.models.gpt2 import GPT2
from minfer.models.loader import ModelNotFoundError, load_model_weights, resolve_model_dir


def copy_checkpoint(src, dst):
    shutil.copytree(src, dst)
    return dst


def one_line(message: str):
    assert "\n" not in message and "Traceback" not in message and len(message) < 400, message


def test_both_layouts_give_the_same_model(make_checkpoint):
    hub = GPT2.from_pretrained(make_checkpoint("tiny", "hub"))
    tf = GPT2.from_pretrained(make_checkpoint("tiny", "transformers"))
    for (name, a), (_, b) in zip(hub.state_dict().items(), tf.state_dict().items()):
        assert torch.equal(a, b), name


def test_conv1d_weights_are_transposed(tiny_checkpoint):
    raw = load_file(str(tiny_checkpoint / "model.safetensors"))
    model = GPT2.from_pretrained(tiny_checkpoint)
    assert raw["h.0.attn.c_attn.weight"].shape == (64, 192)  # stored [in, out]
    assert torch.equal(model.h[0].attn.c_attn.weight, raw["h.0.attn.c_attn.weight"].t())


def test_sharded_checkpoint_loads(tiny_checkpoint, tmp_path):
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
        weight_map.update({k: file for k in keys})
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(tiny_checkpoint / "config.json", tmp_path)
    sharded = GPT2.from_pretrained(tmp_path)
    single = GPT2.from_pretrained(tiny_checkpoint)
    ids = torch.arange(10)[None]
    with torch.inference_mode():
        assert torch.equal(sharded(ids), single(ids))


def write_shards(tiny_checkpoint, d):
    """tiny_checkpoint's tensors in two shards under d, and their index; returns the index's weight_map."""
    d.mkdir()
    shutil.copy(tiny_checkpoint / "config.json", d)
    tensors = load_file(str(tiny_checkpoint / "model.safetensors"))
    names = sorted(tensors)
    weight_map = {}
    for file, keys in (("model-1.safetensors", names[::2]), ("model-2.safetensors", names[1::2])):
        save_file({k: tensors[k] for k in keys}, str(d / file))
        weight_map.update(dict.fromkeys(keys, file))
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def other_shard(name):
    return "model-2.safetensors" if name == "model-1.safetensors" else "model-1.safetensors"


def add_to_shard(d, file, name, tensor):
    tensors = load_file(str(d / file))
    tensors[name] = tensor
    save_file(tensors, str(d / file))


BAD_INDEXES = {  # what is done to a sharded checkpoint -> what the error says
    "weight_map not an object": (
        lambda d, m: {"weight_map": list(m)}, "weight_map must map tensor names to shard file names"
    ),
    "a shard named by a number": (
        lambda d, m: {"weight_map": {**m, "ln_f.bias": 2}}, "weight_map must map tensor names to shard file names"
    ),
    "a tensor in no shard": (
        lambda d, m: {"weight_map": {**m, "h.0.attn.c_proj.weight2": "model-1.safetensors"}},
        "places tensor 'h.0.attn.c_proj.weight2' in model-1.safetensors, which does not hold it",
    ),
    "a tensor in another shard than the index says": (
        lambda d, m: {"weight_map": {**m, "ln_f.bias": other_shard(m["ln_f.bias"])}},
        "places tensor 'ln_f.bias' in model-[12].safetensors, which does not hold it",
    ),
    "a tensor in two shards": (
        lambda d, m: add_to_shard(d, other_shard(m["ln_f.bias"]), "ln_f.bias", torch.full((64,), 7.0)),
        r"tensor 'ln_f.bias' is in both model-1.safetensors and model-2.safetensors",
    ),
}


@pytest.mark.parametrize("case", list(BAD_INDEXES))
def test_a_sharded_checkpoint_must_agree_with_its_index(tiny_checkpoint, tmp_path, case):
    """Each tensor is read from the one shard the index names: never from a second copy, never missed."""
    damage, message = BAD_INDEXES[case]
    d = tmp_path / "sharded"
    index = damage(d, write_shards(tiny_checkpoint, d))
    if index is not None:
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=message) as info:
        GPT2.from_pretrained(d)
    one_line(str(info.value))


def edit_tensors(d, edit):
    tensors = load_file(str(d / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(d / "model.safetensors"))


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def other_architecture(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="llama", architectures=["LlamaForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))


def with_config(**fields):
    def edit(d):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(fields)
        (d / "config.json").write_text(json.dumps(cfg))

    return edit


BAD_CHECKPOINTS = {
    "no safetensors": (lambda d: (d / "model.safetensors").unlink(), FileNotFoundError, "no model.safetensors"),
    "truncated": (lambda d: truncate(d / "model.safetensors"), ValueError, "truncated or corrupt"),
    "not safetensors": (lambda d: (d / "model.safetensors").write_text("hello"), ValueError, "not a readable"),
    "other architecture": (other_architecture, ValueError, "'llama' model, not GPT-2"),
    "no config": (lambda d: (d / "config.json").unlink(), FileNotFoundError, "no config.json"),
    "broken config": (lambda d: (d / "config.json").write_text("{"), ValueError, "not valid JSON"),
    "architectures a string": (
        with_config(architectures="GPT2LMHeadModel"),
        ValueError,
        "architectures must be a list of class names, got 'GPT2LMHeadModel'",
    ),
    "n_inner a string": (with_config(n_inner="256"), ValueError, "n_inner must be a positive integer, or null"),
    "n_inner negative": (
        with_config(n_inner=-1), ValueError, r"n_inner must be a positive integer, or null for 4 \* n_embd, got -1"
    ),
    "tie_word_embeddings a string": (
        with_config(tie_word_embeddings="false"), ValueError, "tie_word_embeddings must be true or false, got 'false'"
    ),
    "tie_word_embeddings null": (  # absent means true for GPT-2; null is neither (transformers refuses it too)
        with_config(tie_word_embeddings=None), ValueError, "tie_word_embeddings must be true or false, got None"
    ),
    "untied without a head": (  # transformers would fill the head with random numbers and run: garbage out
        with_config(tie_word_embeddings=False), ValueError, "lacks tensor 'lm_head.weight'"
    ),
    "epsilon null": (with_config(layer_norm_epsilon=None), ValueError, "layer_norm_epsilon must be a positive number"),
    "epsilon a word": (with_config(layer_norm_epsilon="x"), ValueError, "layer_norm_epsilon must be a positive number"),
    "missing tensor": (
        lambda d: edit_tensors(d, lambda t: t.pop("h.1.mlp.c_fc.bias")),
        ValueError,
        "lacks tensor 'h.1.mlp.c_fc.bias'",
    ),
    "unexpected tensor": (
        lambda d: edit_tensors(d, lambda t: t.update(extra=torch.zeros(2))),
        ValueError,
        "unexpected tensor 'extra'",
    ),
    "wrong shape": (
        lambda d: edit_tensors(d, lambda t: t.update({"ln_f.bias": torch.zeros(65)})),
        ValueError,
        r"'ln_f.bias' .* has shape \[65\], but config.json implies \[64\]",
    ),
    "integer weights": (  # another tool's quantized weights, say: cast to float, they would run as garbage
        lambda d: edit_tensors(d, lambda t: t.update({"ln_f.weight": t["ln_f.weight"].to(torch.int8)})),
        ValueError,
        "'ln_f.weight' in model.safetensors holds I8 values, not floats",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CHECKPOINTS))
def test_bad_checkpoint_gives_a_clear_error(tiny_checkpoint, tmp_path, case):
    damage, error, message = BAD_CHECKPOINTS[case]
    d = copy_checkpoint(tiny_checkpoint, tmp_path / "ck")
    damage(d)
    with pytest.raises(error, match=message) as info:
        GPT2.from_pretrained(d)
    one_line(str(info.value))


def test_missing_local_path_is_not_sent_to_the_hub(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        resolve_model_dir(str(tmp_path / "nope"))


def test_unreachable_hub_id_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", True)
    with pytest.raises(ModelNotFoundError) as info:
        resolve_model_dir("someone/not-cached-model")
    message = str(info.value)
    one_line(message)
    assert "HF_HUB_OFFLINE" in message and "local checkpoint directory" in message
    assert "--model minfer-tiny" in message  # the shipped model: the offline choice a newcomer can run now


def test_hub_id_found_in_cache_offline(monkeypatch, tiny_checkpoint):
    """An id resolves through huggingface_hub, which also serves its cache when offline."""
    calls = {}

    def fake_snapshot_download(repo_id, allow_patterns):
        calls.update(repo_id=repo_id, allow_patterns=allow_patterns)
        return str(tiny_checkpoint)

    monkeypatch.setattr("huggingface_hub.snapshot_download", fake_snapshot_download)
    assert resolve_model_dir("gpt2") == tiny_checkpoint
    assert calls["repo_id"] == "openai-community/gpt2"
    assert "model.safetensors" in calls["allow_patterns"] and "*.bin" not in calls["allow_patterns"]


def test_cli_error_is_one_line_without_traceback(tmp_path):
    env_cmd = [sys.executable, "-m", "minfer.generate", "--model", str(tmp_path), "hello"]
    result = run_python(env_cmd, timeout=60)  # in a fork of a process that has imported torch
    assert result.returncode == 1
    err = result.stderr.strip()
    assert err.startswith("error: no config.json") and "Traceback" not in err
    one_line(err)


def test_load_model_weights_casts_dtype(tiny_checkpoint):
    with torch.device("meta"):
        model = GPT2(GPT2Config.from_json(tiny_checkpoint))
    state = load_model_weights(model, tiny_checkpoint, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in state.values())
    assert all(t.is_contiguous() for t in state.values())
