"""Quantized checkpoints (`minfer quantize`): quantized while loading equals quantized after loading, saved and
loaded back the same model exactly; a truncated, incomplete or altered one is refused naming what is wrong, and
one quantized by another tool (GPTQ, AWQ) is refused saying what runs."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from minfer import LLM, SamplingParams
from minfer.models.registry import load_model
from minfer.quantization import QuantizedLinear, int4_kernel_available, quantization_of, quantize_model
from minfer.quantization.checkpoint import QuantizationSpec, QuantizedWeights, save_quantized

needs_int4 = pytest.mark.skipif(not int4_kernel_available(), reason="torch's CPU int4 kernels need torch >= 2.6")
GREEDY = SamplingParams(temperature=0, max_tokens=24)


CHECKPOINTS = {  # make_checkpoint's arguments: a tied LM head and untied ones (their embedding quantized apart)
    "gpt2": dict(preset="tiny"),
    "gpt2-untied": dict(preset="tiny", tie_word_embeddings=False),
    "llama-untied": dict(preset="llama-tiny"),
}


@pytest.mark.parametrize("checkpoint", list(CHECKPOINTS))
@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_quantized_checkpoint_round_trip(make_checkpoint, tmp_path, checkpoint, method):
    """Quantized while loading == quantized after loading; saved and loaded back: the same model exactly."""
    source = make_checkpoint(**CHECKPOINTS[checkpoint])
    spec = QuantizationSpec(method)
    streamed = load_model(source, weights=QuantizedWeights(spec))
    after = quantize_model(load_model(source), method)
    out = save_quantized(streamed, source, tmp_path / "q", spec)
    loaded = load_model(out, weights=QuantizedWeights())
    assert isinstance(loaded.lm_head, QuantizedLinear)
    ids = torch.randint(0, 500, (1, 7))
    with torch.inference_mode():
        expected = after(ids)
        torch.testing.assert_close(streamed(ids), expected, atol=0, rtol=0)
        torch.testing.assert_close(loaded(ids), expected, atol=0, rtol=0)
    assert LLM(str(out), quantization=method).generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0].token_ids
    with pytest.raises(ValueError, match=f"holds {method} weights; it cannot be loaded as"):
        LLM(str(out), quantization="int4" if method == "int8" else "int8")


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_minfer_quantize_with_its_defaults_loads_as_quantizing_at_load_in_any_dtype(make_checkpoint, tmp_path,
                                                                                     preset, method):
    """`minfer quantize SRC DST` then `--model DST --dtype D` is `--model SRC --quantization M --dtype D`, for an
    fp32 source: each weight is quantized from its stored precision, not from its copy in the load's dtype, and
    what stays full precision keeps its own (DST written in bf16 once gave fp32 loads other weights and logits)."""
    from minfer import quantize

    source, out = make_checkpoint(preset), tmp_path / "q"
    assert quantize.main([str(source), str(out), "--quantization", method]) == 0
    ids = torch.randint(0, 500, (1, 60))  # 60 rows: the dequantize + GEMM path, exact in fp32
    for dtype in (torch.float32, torch.bfloat16):
        at_load = load_model(source, dtype=dtype, weights=QuantizedWeights(QuantizationSpec(method)))
        written = load_model(out, dtype=dtype, weights=QuantizedWeights())
        for (name, got), (_, want) in zip(written.state_dict().items(), at_load.state_dict().items()):
            assert torch.equal(got, want), f"{name} in {dtype}"
        with torch.inference_mode():
            torch.testing.assert_close(written(ids), at_load(ids), atol=0, rtol=0)


@needs_int4
def test_a_quantized_checkpoint_refuses_settings_it_was_not_written_with(make_checkpoint, tmp_path):
    """Its weights are quantized already: a group size or a float head it was not written with cannot be applied."""
    out = save_quantized(load_model(make_checkpoint(), weights=QuantizedWeights(QuantizationSpec("int4"))),
                         make_checkpoint(), tmp_path / "q4", QuantizationSpec("int4"))  # groups of 64, head quantized
    with pytest.raises(ValueError, match="holds int4 weights in groups of 64; it cannot be loaded with groups of 32"):
        LLM(str(out), quantization="int4", quantization_group_size=32)
    with pytest.raises(ValueError, match="its LM head quantized; it cannot be loaded with --no-quantize-lm-head"):
        LLM(str(out), quantization="int4", quantize_lm_head=False)
    assert LLM(str(out), quantization="int4", quantization_group_size=64).generate([[1, 2]], GREEDY, use_tqdm=False)


def quantized_copy(make_checkpoint, tmp_path):
    from minfer import quantize

    out = tmp_path / "q8"
    assert quantize.main([str(make_checkpoint()), str(out), "--quantization", "int8"]) == 0
    return out


def test_a_corrupt_or_incomplete_quantized_checkpoint_is_refused(make_checkpoint, tmp_path):
    from safetensors.torch import load_file, save_file

    out = quantized_copy(make_checkpoint, tmp_path)
    weights = out / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])  # truncated
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_model(out, weights=QuantizedWeights())
    weights.write_bytes(data)
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if k != "h.1.mlp.c_fc.scales"}, str(weights))
    with pytest.raises(ValueError, match="lacks h.1.mlp.c_fc.scales"):
        load_model(out, weights=QuantizedWeights())
    tensors["h.0.ln_1.weight"] = torch.ones(3)
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="h.0.ln_1.weight"):
        load_model(out, weights=QuantizedWeights())


@needs_int4
def test_a_quantization_config_minfer_does_not_write_is_refused_naming_the_file(make_checkpoint, tmp_path):
    """A hand-edited config.json: its group size is refused as the file's (it was blamed on a flag no one gave),
    a quantize_lm_head that is no boolean is refused (bool("no") loaded it as True), and a full-precision tensor
    stored as integers is refused as the plain loader refuses it (it loaded as garbage weights)."""
    source = make_checkpoint()
    out = save_quantized(load_model(source, weights=QuantizedWeights(QuantizationSpec("int4"))), source,
                         tmp_path / "q4", QuantizationSpec("int4"))
    config = json.loads((out / "config.json").read_text())
    for edit, message in (
        ({"group_size": 48}, "quantization_config's group_size is 48; an int4 checkpoint minfer writes has 32, 64"),
        ({"group_size": 64.0}, "quantization_config's group_size is 64.0"),
        ({"format": "int8", "group_size": 64}, "quantization_config's group_size is 64; an int8 checkpoint minfer "
                                               "writes has none"),
        ({"quantize_lm_head": "no"}, "quantization_config's quantize_lm_head is 'no', not true or false"),
    ):
        (out / "config.json").write_text(json.dumps(config | {"quantization_config": config["quantization_config"]
                                                              | edit}))
        with pytest.raises(ValueError, match=str(out / "config.json")) as refused:
            LLM(str(out))
        assert message in str(refused.value)
    (out / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(out / "model.safetensors"))
    tensors["h.0.ln_1.weight"] = tensors["h.0.ln_1.weight"].to(torch.int32)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="holds 'h.0.ln_1.weight' as torch.int32, not floats"):
        LLM(str(out))


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_checkpoints_quantized_by_other_tools_are_refused_saying_what_runs(make_checkpoint, tmp_path, method):
    import json
    import shutil

    out = tmp_path / method
    shutil.copytree(make_checkpoint(), out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=rf"quantized as '{method}'.*--quantization int8 or int4.*minfer quantize"):
        load_model(out, weights=QuantizedWeights())


def test_quantize_writes_over_its_own_output_only(make_checkpoint, tmp_path, capsys):
    """A rerun writes over what it wrote; someone's files, the source itself, a file or an empty name are refused
    before anything is written, and a quantized source is refused (quantizing it again changes nothing)."""
    from minfer import quantize

    source, out = make_checkpoint(), tmp_path / "q8"
    for _ in range(2):
        assert quantize.main([str(source), str(out), "--quantization", "int8"]) == 0
    someones = tmp_path / "someones"
    someones.mkdir()
    (someones / "config.json").write_text('{"model_type": "gpt2"}')
    (tmp_path / "a-file").write_text("")
    refusals = {
        str(someones): f"{someones} is not empty and holds no quantized checkpoint of minfer's: pass --force",
        str(tmp_path / "a-file"): "exists and is not a directory",
        "": "the output directory is empty: name the directory to write",
        str(source): f"{source} is not empty and holds no quantized checkpoint of minfer's",
    }
    for dst, message in refusals.items():
        with pytest.raises(SystemExit) as e:
            quantize.main([str(source), dst, "--quantization", "int8"])
        assert e.value.code == 2 and message in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:  # a flag of int4's with int8: a bad flag, refused before loading
        quantize.main([str(source), str(tmp_path / "q8-grouped"), "--quantization", "int8",
                       "--quantization-group-size", "64"])
    assert e.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        "python -m minfer.quantize: error: --quantization-group-size applies to --quantization int4 only")
    assert (someones / "config.json").read_text() == '{"model_type": "gpt2"}'
    assert quantize.main([str(source), str(source), "--quantization", "int8", "--force"]) == 1
    assert "is the checkpoint being quantized: write the quantized one elsewhere" in capsys.readouterr().err
    assert quantize.main([str(out), str(tmp_path / "q8-again"), "--quantization", "int8"]) == 1
    assert f"{out} is quantized already: quantize its full-precision checkpoint" in capsys.readouterr().err
    assert quantize.main([str(source), str(someones), "--quantization", "int8", "--force"]) == 0


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_a_quantized_checkpoint_serves_as_a_draft_model(make_checkpoint, tmp_path, method):
    """--speculative-model DIR written by `minfer quantize` loads quantized, as --model DIR does; it was refused
    with "load it through minfer's engine (LLM, build_engine)", the very call that refused it."""
    target, draft = make_checkpoint(), make_checkpoint(seed=1)
    spec = QuantizationSpec(method)
    out = save_quantized(load_model(draft, weights=QuantizedWeights(spec)), draft, tmp_path / "draft", spec)
    llm = LLM(target, speculative_method="draft", speculative_model=str(out), num_speculative_tokens=3)
    assert quantization_of(llm.scheduler.features.speculation.draft.model) == method
    prompts = [[1, 2, 3, 4], list(range(40, 90))]
    want = [o.token_ids for o in LLM(target).generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert llm.scheduler.stats()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.parametrize("preset, embedding", [("tiny", "wte.weight"), ("llama-tiny", "model.embed_tokens.weight")])
def test_a_head_stored_apart_from_the_embedding_its_config_ties_stays_apart_when_saved(make_checkpoint, tmp_path,
                                                                                      preset, embedding):
    """The loader keeps a stored head that differs from the embedding config.json ties it to (as transformers
    does): the quantized checkpoint says it is untied, and one whose config.json still ties them is refused."""
    source = tmp_path / "tied"
    shutil.copytree(make_checkpoint(preset, tie_word_embeddings=True), source)
    tensors = load_file(str(source / "model.safetensors"))
    tensors["lm_head.weight"] = torch.randn_like(tensors[embedding])
    save_file(tensors, str(source / "model.safetensors"))
    spec = QuantizationSpec("int8")
    model = load_model(source, weights=QuantizedWeights(spec))
    out = save_quantized(model, source, tmp_path / "q", spec)
    assert json.loads((out / "config.json").read_text())["tie_word_embeddings"] is False
    ids = torch.randint(0, 500, (1, 7))
    with torch.inference_mode():
        torch.testing.assert_close(load_model(out, weights=QuantizedWeights())(ids), model(ids), atol=0, rtol=0)
    raw = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps(raw | {"tie_word_embeddings": True}))
    with pytest.raises(ValueError, match="holds quantized tensors of 'lm_head.weight', which this model does not"):
        load_model(out, weights=QuantizedWeights())
