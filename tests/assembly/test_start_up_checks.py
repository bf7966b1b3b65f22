"""What start-up reads and refuses before the weights load: a tokenizer the model cannot embed, config.json read
once for the model, and every flag the model cannot take checked once by the assembly."""

import json
import logging
import pathlib
import shutil

import pytest
import tokenizers
import torch
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken

import minfer.assembly.build as build_module
from minfer import LLM, EngineConfig, SamplingParams
from minfer.server.serve import create_server

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def copy_with(source, d, **config):
    shutil.copytree(source, d)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(raw | config))
    return d


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_the_weights_load(tiny_checkpoint, tmp_path,
                                                                                  monkeypatch):
    """tokenizer.json writes text in 511 tokens; a model with 300 embeddings cannot read them (another model's
    tokenizer). transformers loads the pair and fails at the first such id; minfer says why at start-up."""
    d = copy_with(tiny_checkpoint, tmp_path / "small-vocab", vocab_size=300)
    monkeypatch.setattr(build_module, "load_model", lambda *a, **k: pytest.fail("the weights were loaded"))
    message = (f"{d / 'tokenizer.json'} holds 511 tokens, but {d / 'config.json'} gives the model 300 (vocab_size): "
               "it cannot embed the rest; is the tokenizer another model's?")
    with pytest.raises(ValueError) as info:
        create_server(EngineConfig(str(d)), port=0)
    assert str(info.value) == message


def test_tokens_added_past_the_embedding_are_named_at_start_up_and_refused_in_prompts(tiny_checkpoint, tmp_path,
                                                                                       caplog):
    """A pad token added to the tokenizer without growing the embedding: the model still runs, the start-up
    warning names the token, and a prompt holding it is refused rather than run past the embedding."""
    d = tmp_path / "added-pad"
    shutil.copytree(tiny_checkpoint, d)
    backend = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    backend.add_special_tokens([AddedToken("<pad>", special=True, normalized=False)])
    backend.save(str(d / "tokenizer.json"))
    with caplog.at_level(logging.WARNING, logger="minfer"):
        llm = LLM(str(d), num_kv_blocks=16)
    warned = [r.getMessage() for r in caplog.records if "past the 512 the model embeds" in r.getMessage()]
    assert len(warned) == 1 and "'<pad>' (id 512)" in warned[0], caplog.text
    assert len(llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].token_ids) == 4
    with pytest.raises(ValueError, match=r"prompt token id 512 is not in the vocabulary \[0, 512\)"):
        llm.generate(["Hello<pad>"], GREEDY, use_tqdm=False)


def test_a_tokenizer_smaller_than_the_embedding_loads_quietly(make_checkpoint, tmp_path, caplog):
    """Padded embeddings (Qwen3: 151,669 tokens, 151,936 rows) are the common case, not a mistake."""
    path = copy_with(make_checkpoint("qwen3-tiny"), tmp_path / "padded", vocab_size=640)
    tensors = load_file(str(path / "model.safetensors"))
    embedding = tensors["model.embed_tokens.weight"]  # tied: the LM head too
    tensors["model.embed_tokens.weight"] = torch.cat([embedding, torch.zeros(128, embedding.shape[1])])
    save_file(tensors, str(path / "model.safetensors"))
    with caplog.at_level(logging.WARNING, logger="minfer"):
        llm = LLM(str(path), num_kv_blocks=16)
    assert llm.model.config.vocab_size == 640 and llm.tokenizer.vocab_size == 512
    assert "the model embeds" not in caplog.text
    assert len(llm.generate(["Hello"], GREEDY, use_tqdm=False)[0].token_ids) == 4


def test_config_json_is_read_once_for_the_model(tiny_checkpoint, monkeypatch):
    """The loader, the architecture's lookup and the flag checks share one reading (the tokenizer reads its EOS
    ids from it once more): it was read eight times."""
    reads = []
    read_text = pathlib.Path.read_text

    def counted(path, *args, **kwargs):
        if path.name == "config.json":
            reads.append(path)
        return read_text(path, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "read_text", counted)
    srv = create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=16), port=0)
    srv.manager.shutdown()
    srv.server_close()
    assert len(reads) == 2, reads


@pytest.mark.parametrize("speculative", [{}, {"speculative_method": "draft"}])
def test_num_kv_blocks_is_checked_once_by_the_assembly(tiny_checkpoint, monkeypatch, speculative):
    """--num-kv-blocks is refused before the weights load, by one check the draft's cache relies on too; the
    scheduler's own check (engine/scheduler.py, for engines built without build_engine) is the only other."""
    from minfer.engine import scheduler as scheduler_module

    calls = []
    checked = build_module.check_num_blocks
    monkeypatch.setattr(build_module, "check_num_blocks", lambda *a: calls.append("assembly") or checked(*a))
    monkeypatch.setattr(scheduler_module, "check_num_blocks", lambda *a: calls.append("scheduler") or checked(*a))
    if speculative:
        speculative = {**speculative, "speculative_model": str(tiny_checkpoint), "num_speculative_tokens": 2}
    LLM(str(tiny_checkpoint), num_kv_blocks=16, **speculative)
    assert calls == ["assembly", "scheduler"]
