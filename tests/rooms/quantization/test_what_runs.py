"""What a quantized engine says it runs: /health's quantization fields (the engine config it ran), the server's
banner and the parameter count, told from the model, whether it was quantized as it loaded or read from a
`minfer quantize` checkpoint; and the compile choice, which counts a model's parameters as its float ones."""

import pytest
import torch

from minfer import LLM
from minfer.assembly import compile_choice
from minfer.assembly.compile_choice import why_not_compiled
from minfer.engine.config import EngineConfig
from minfer.models.registry import load_model
from minfer.quantization import int4_kernel_available, quantize_model
from minfer.quantization.checkpoint import QuantizationSpec, QuantizedWeights, save_quantized
from minfer.quantization.describe import num_parameters
from minfer.server.banner import banner_lines

needs_int4 = pytest.mark.skipif(not int4_kernel_available(), reason="torch's CPU int4 kernels need torch >= 2.6")
FIELDS = ("quantization", "quantization_group_size", "quantize_lm_head", "quantize_activations")


def ran(llm: LLM) -> tuple:
    return tuple(getattr(llm.scheduler.engine_config, name) for name in FIELDS)


def banner(llm: LLM) -> str:
    return "\n".join(banner_lines(llm.scheduler, "float32", "http://127.0.0.1:1", False))


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])  # a tied head and an untied one
@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
@pytest.mark.parametrize("quantize_lm_head", [True, False])
def test_a_quantized_model_has_the_parameters_of_its_float_one(make_checkpoint, preset, method, quantize_lm_head):
    """int4 packs two weights a byte: counting its elements said GPT-2 124M had 66.6M parameters."""
    checkpoint = make_checkpoint(preset)
    float_count = sum(p.numel() for p in load_model(checkpoint).parameters())
    model = quantize_model(load_model(checkpoint), method, quantize_lm_head=quantize_lm_head)
    assert num_parameters(model) == float_count


@needs_int4
def test_health_and_the_banner_say_the_quantization_that_runs(tiny_checkpoint):
    """int4's group size left to its default is the 64 it runs, not null; the banner names the quantization and
    counts the float model's parameters, not the packed bytes."""
    plain = LLM(tiny_checkpoint)
    count = f"(GPT2, {sum(p.numel() for p in plain.model.parameters()) / 1e6:.1f}M parameters)"
    assert count in banner(plain) and "quantization:" not in banner(plain)
    assert ran(plain) == (None, None, True, False)
    int4 = LLM(tiny_checkpoint, quantization="int4")
    assert ran(int4) == ("int4", 64, True, False)
    assert count in banner(int4), banner(int4)
    assert "quantization: int4 weights in groups of 64, the LM head too: " in banner(int4)
    int8 = LLM(tiny_checkpoint, quantization="int8", quantize_lm_head=False, quantize_activations=True)
    assert ran(int8) == ("int8", None, False, True)
    assert "quantization: int8 weights, the LM head in float32, int8 activations: " in banner(int8)


@needs_int4
def test_a_quantized_checkpoint_reports_what_it_was_written_with(tiny_checkpoint, tmp_path):
    """Loaded without any quantization flag, /health said group size null and the LM head quantized."""
    spec = QuantizationSpec("int4", group_size=32, quantize_lm_head=False)
    model = load_model(tiny_checkpoint, weights=QuantizedWeights(spec))
    out = save_quantized(model, tiny_checkpoint, tmp_path / "q", spec)
    llm = LLM(str(out))
    assert ran(llm) == ("int4", 32, False, False)
    assert "quantization: int4 weights in groups of 32, the LM head in float32: " in banner(llm)


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_the_compile_choice_counts_a_quantized_models_float_parameters(tiny_checkpoint, method, monkeypatch):
    """A model just over the size that compiles by default still does quantized: int4 counted half its weights."""
    model = load_model(tiny_checkpoint)
    monkeypatch.setattr(compile_choice, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(compile_choice, "MIN_PARAMETERS", sum(p.numel() for p in model.parameters()))
    monkeypatch.setattr(compile_choice, "open_cache", lambda: ("a cache", None))
    quantized = quantize_model(model.to(torch.bfloat16), method)
    assert why_not_compiled(EngineConfig(quantization=method), quantized) is None


@pytest.mark.parametrize("method", ["int8", pytest.param("int4", marks=needs_int4)])
def test_no_quantize_lm_head_keeps_an_untied_embedding_in_full_precision_too(make_checkpoint, method):
    """As docs/quantization.md says: --no-quantize-lm-head keeps the token embedding, tied to the head or not (Llama),
    in full precision, whether quantized after loading or while loading; every block's linear is quantized."""
    checkpoint = make_checkpoint("llama-tiny")
    after = quantize_model(load_model(checkpoint), method, quantize_lm_head=False)
    streamed = load_model(checkpoint, weights=QuantizedWeights(QuantizationSpec(method, quantize_lm_head=False)))
    for model in (after, streamed):
        assert type(model.embed_tokens) is torch.nn.Embedding and type(model.lm_head) is torch.nn.Linear
        assert model.embed_tokens.weight is not model.lm_head.weight
        assert not any(type(m) is torch.nn.Linear for m in model.modules() if m is not model.lm_head)
