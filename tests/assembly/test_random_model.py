"""The random checkpoints everything offline depends on."""

import json
import subprocess
import sys

import pytest
from safetensors import safe_open
from script_forks import run_python

from minfer.checkpoints import make_config, random_state_dict, train_tokenizer, write_random_checkpoint
from minfer.models.config import GPT2Config
from minfer.text.tokenizer import Tokenizer


@pytest.mark.parametrize("layout", ["hub", "transformers"])
def test_cli_writes_a_complete_checkpoint(tmp_path, layout):
    out = tmp_path / "ck"
    cmd = [sys.executable, "-m", "minfer.random_model", str(out), "--config", "tiny", "--layout", layout]
    done = run_python(cmd, timeout=120)  # in a fork of a process that has imported torch
    assert done.returncode == 0, done.stderr
    config = GPT2Config.from_json(out / "config.json")
    tokenizer = Tokenizer.from_dir(out)
    assert tokenizer.vocab_size == config.vocab_size == 512
    assert tokenizer.eos_token_id == json.loads((out / "config.json").read_text())["eos_token_id"] == 511
    assert tokenizer.decode(tokenizer.encode("Hello, 世界")) == "Hello, 世界"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    prefix = "transformer." if layout == "transformers" else ""
    assert prefix + "h.1.mlp.c_proj.weight" in keys and "lm_head.weight" not in keys
    assert (prefix + "h.0.attn.bias" in keys) == (layout == "hub")  # the Hub file's mask buffer


def test_weights_are_seeded():
    config = make_config("tiny")
    a, b, c = (random_state_dict(config, "hub", seed) for seed in (0, 0, 1))
    assert all((a[k] == b[k]).all() for k in a)
    assert not (a["wte.weight"] == c["wte.weight"]).all()


HASH_CHECKPOINTS = """
import hashlib, tempfile
from minfer.checkpoints import write_random_checkpoint
for preset in ("tiny", "llama2-tiny", "qwen3-tiny", "llama-tiny"):
    with tempfile.TemporaryDirectory() as out:
        path = write_random_checkpoint(out, preset, "hub", 0)
        files = sorted(p for p in path.iterdir() if p.is_file())
        print(preset, [(p.name, hashlib.sha256(p.read_bytes()).hexdigest()) for p in files])
"""


def test_a_seed_writes_the_same_files_in_every_process():
    """Weights, configs and tokenizers alike: the tokenizer trainer's choices among equal counts follow a
    hash map seeded per process, so two fresh processes (not forks, which inherit the seed) must agree."""
    runs = [subprocess.run([sys.executable, "-c", HASH_CHECKPOINTS], capture_output=True, text=True, timeout=120)
            for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr
    assert runs[0].stdout == runs[1].stdout and runs[0].stdout.count("tokenizer.json") == 4


def test_gpt2_sized_vocabulary_is_exact():
    assert make_config("gpt2")["vocab_size"] == 50257
    tok = train_tokenizer(2000)  # the synthetic words make large vocabularies reachable
    assert tok.get_vocab_size() == 2000 and tok.token_to_id("<|endoftext|>") == 1999


def test_config_json_is_what_transformers_expects():
    config = make_config("tiny", n_head=8)
    assert config["model_type"] == "gpt2" and config["n_head"] == 8
    json.dumps(config)
    with pytest.raises(ValueError, match="divisible by n_head"):
        make_config("tiny", n_head=5)


def test_every_file_gets_the_same_mode(tmp_path):
    """safetensors writes 0600; the checkpoint's files all get the umask's mode, as config.json does."""
    out = write_random_checkpoint(tmp_path / "m")
    modes = {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes


def test_the_llama2_preset_writes_a_sentencepiece_style_checkpoint(tmp_path, capsys):
    """`--config llama2-tiny`: a LlamaForCausalLM whose tokenizer.json is Llama 2's kind (BPE with byte
    fallback, Metaspace, the decoder that turns ▁ and <0xHH> back, <s> put before a prompt)."""
    from minfer.checkpoints.__main__ import main

    assert main([str(tmp_path), "--config", "llama2-tiny"]) == 0 and "llama2-tiny" in capsys.readouterr().out
    spec = json.loads((tmp_path / "tokenizer.json").read_text(encoding="utf-8"))
    assert spec["model"]["type"] == "BPE" and spec["model"]["byte_fallback"] and spec["model"]["unk_token"] == "<unk>"
    assert spec["pre_tokenizer"]["type"] == "Metaspace"
    assert [d["type"] for d in spec["decoder"]["decoders"]] == ["Replace", "ByteFallback", "Fuse", "Strip"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and (config["bos_token_id"], config["eos_token_id"]) == (1, 2)
    tokenizer = Tokenizer.from_dir(tmp_path)
    assert tokenizer.vocab_size == config["vocab_size"] == 512 and tokenizer.eos_token_ids == [2]
    assert tokenizer.encode_prompt("Hello\n世界")[0] == 1
    assert tokenizer.decode(tokenizer.encode_prompt("Hello\n世界 🤖")) == "Hello\n世界 🤖"


def test_the_cli_overwrites_its_own_checkpoints_and_nothing_else(tmp_path, capsys):
    from minfer.checkpoints.__main__ import main

    def cli(*argv):
        try:
            code = main(list(argv))
        except SystemExit as e:
            code = e.code
        err = capsys.readouterr().err.strip()
        return code, err.splitlines()[-1] if err else ""

    out = tmp_path / "ck"
    assert cli(str(out)) == (0, "")
    assert cli(str(out), "--seed", "3") == (0, "")  # its own checkpoint: written again, as a README command may be
    someones = tmp_path / "someones-model"  # a checkpoint of another's, or any other files: refused unasked
    someones.mkdir()
    (someones / "model.safetensors").write_bytes(b"weights")
    refusal = "is not empty and holds no random checkpoint of minfer's: pass --force to write into it anyway"
    assert cli(str(someones)) == (2, f"python -m minfer.random_model: error: {someones} {refusal}")
    assert (someones / "model.safetensors").read_bytes() == b"weights" and len(list(someones.iterdir())) == 1
    assert cli(str(someones), "--force")[0] == 0 and (someones / "config.json").exists()
    (tmp_path / "a-file").write_text("")
    assert cli(str(tmp_path / "a-file")) == (2, f"python -m minfer.random_model: error: {tmp_path / 'a-file'} exists "
                                              "and is not a directory")
    assert cli("") == (2, "python -m minfer.random_model: error: the output directory is empty: name the directory to write")
    for seed in (str(2**64), "-1"):  # the engine's range (2**64 overflowed torch's generator): refused before writing
        assert cli(str(tmp_path / "seeded"), "--seed", seed) == (
            2, f"python -m minfer.random_model: error: --seed must be an integer in [0, 2**64), as the engine's, "
            f"got {seed}")
    assert not (tmp_path / "seeded").exists()
    assert cli("/proc/no-such-dir") == (1, "python -m minfer.random_model: error: cannot write /proc/no-such-dir: No such "
                                         "file or directory")  # cannot be made: one line, not a traceback
