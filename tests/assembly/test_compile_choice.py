"""Where nobody chose, a CPU compiles the whole forward only where it wins (assembly/compile_choice.py)."""

import pytest
import torch

from minfer import EngineConfig
from minfer.assembly import build, compile_choice
from minfer.assembly.compile_choice import why_not_compiled, with_compile_choice
from minfer.engine.scheduler import OnlineScheduler
from minfer.models.registry import load_model
from minfer.text.tokenizer import Tokenizer


@pytest.fixture
def model(tiny_checkpoint):
    return load_model(str(tiny_checkpoint), device="cpu")


@pytest.fixture
def amx(monkeypatch):
    """An AMX CPU, and every model big enough."""
    monkeypatch.setattr(compile_choice, "cpu_has_amx", lambda: True)
    monkeypatch.setattr(compile_choice, "MIN_PARAMETERS", 0)


def test_an_amx_cpu_compiles_fp32_bf16_int8_and_int4_models_by_default(model, amx):
    assert why_not_compiled(EngineConfig(), model) is None  # fp32
    assert with_compile_choice(EngineConfig(), model).compile_model is True
    for method in ("int8", "int4"):
        assert why_not_compiled(EngineConfig(quantization=method), model) is None  # fp32 activations
        assert with_compile_choice(EngineConfig(quantization=method), model).compile_model is True
    bf16 = model.to(torch.bfloat16)
    assert why_not_compiled(EngineConfig(), bf16) is None
    assert why_not_compiled(EngineConfig(quantization="int8"), bf16) is None
    assert why_not_compiled(EngineConfig(quantization="int4"), bf16) is None


@pytest.mark.parametrize("config, reason", [
    (EngineConfig(enforce_eager=True), "another choice"),
    (EngineConfig(compile_decode_step=True), "another choice"),
    (EngineConfig(quantization="int8", quantize_activations=True), "another choice"),
    (EngineConfig(speculative_method="ngram"), "speculative"),
])
def test_what_was_not_measured_with_it_stays_eager(model, amx, config, reason):
    bf16 = model.to(torch.bfloat16)
    assert reason in why_not_compiled(config, bf16)
    assert with_compile_choice(config, bf16).compile_model is False


def test_fp16_stays_eager(model, amx):
    assert "float16" in why_not_compiled(EngineConfig(), model.to(torch.float16))


def test_an_avx2_only_cpu_compiles_the_lone_decode_of_int8_and_int4_models_alone(model, monkeypatch):
    """int8 batch 1 1.3-1.6x faster compiled, 64 requests 15% slower; int4 batch 1 1.13-1.17x: the lone decode
    compiles, batches stay eager."""
    monkeypatch.setattr(compile_choice, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(compile_choice, "cpu_has_native_bf16", lambda: False)
    monkeypatch.setattr(compile_choice, "MIN_PARAMETERS", 0)
    for method in ("int8", "int4"):
        quantized = EngineConfig(quantization=method)
        assert why_not_compiled(quantized, model) is None and compile_choice.lone_only(quantized, model)
    assert not compile_choice.lone_only(EngineConfig(), model)
    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype)
        assert "not compiled by default on AVX2 alone" in why_not_compiled(EngineConfig(), m)
        assert with_compile_choice(EngineConfig(), m).compile_model is False
        assert with_compile_choice(EngineConfig(compile_model=True), m).compile_model is True


def test_an_avx512_bf16_cpu_without_amx_compiles_fp32_and_bf16_models_and_the_lone_decode_of_quantized_ones(
        model, monkeypatch, caplog):
    """A real Zen 4: fp32 and bf16 won compiled at batch 1 and kept up at batches; int8 and int4 at batch 1 alone
    (their lone decode compiles, batches stay eager)."""
    monkeypatch.setattr(compile_choice, "cpu_has_amx", lambda: False)
    monkeypatch.setattr(compile_choice, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(compile_choice, "MIN_PARAMETERS", 0)
    for dtype in (torch.float32, torch.bfloat16):
        m = model.to(dtype)  # in place
        caplog.clear()
        with caplog.at_level("INFO", logger="minfer"):
            assert with_compile_choice(EngineConfig(), m).compile_model is True
        assert "the default on a CPU with AVX512-BF16" in caplog.text and "lone" not in caplog.text
        assert not compile_choice.lone_only(EngineConfig(), m)
    bf16 = model.to(torch.bfloat16)
    for method in ("int4", "int8"):
        config = EngineConfig(quantization=method)
        assert with_compile_choice(config, bf16).compile_model is True
        assert compile_choice.lone_only(config, bf16)
    assert "float16 with unquantized weights is not compiled by default on AVX512-BF16" in why_not_compiled(
        EngineConfig(), model.to(torch.float16))


def test_a_choice_given_is_kept(model, amx):
    assert with_compile_choice(EngineConfig(compile_model=False), model.to(torch.bfloat16)).compile_model is False


def test_a_small_model_stays_eager(model, monkeypatch):
    """minfer-tiny and the tests' checkpoints: a first start's compile would cost more than it ever saves."""
    monkeypatch.setattr(compile_choice, "cpu_has_amx", lambda: True)
    assert "small model" in why_not_compiled(EngineConfig(), model.to(torch.bfloat16))


def test_a_model_whose_first_build_would_not_fit_in_the_free_memory_stays_eager(model, amx, monkeypatch):
    """A first start's build held 5.1-5.8x the weights at its peak, 7.6-7.8x quantized ones: with less free
    memory it would be killed."""
    bf16 = model.to(torch.bfloat16)
    weights = sum(t.numel() * t.element_size() for t in [*bf16.parameters(), *bf16.buffers()])
    for quantization, peak in [(None, 7), ("int8", 9), ("int4", 9)]:
        config = EngineConfig(quantization=quantization)
        monkeypatch.setattr(compile_choice, "available_memory", lambda device: (peak - 1) * weights)
        assert "building its packages takes about" in why_not_compiled(config, bf16)
        monkeypatch.setattr(compile_choice, "available_memory", lambda device: peak * weights)
        assert why_not_compiled(config, bf16) is None


def test_a_model_kept_eager_for_memory_says_so_and_a_small_one_stays_quiet(model, monkeypatch, caplog):
    """On an AMX CPU the compiled forward is what a big model gets; where the memory keeps it eager, one log line
    says why. A small model (the README's minfer-tiny) is eager by design, and nothing is said."""
    monkeypatch.setattr(compile_choice, "cpu_has_amx", lambda: True)
    bf16 = model.to(torch.bfloat16)
    with caplog.at_level("INFO", logger="minfer"):
        assert with_compile_choice(EngineConfig(), bf16).compile_model is False  # small
        assert "stays eager" not in caplog.text
        monkeypatch.setattr(compile_choice, "MIN_PARAMETERS", 0)
        monkeypatch.setattr(compile_choice, "available_memory", lambda device: 1)
        assert with_compile_choice(EngineConfig(), bf16).compile_model is False
    assert "the whole forward stays eager" in caplog.text and "building its packages takes about" in caplog.text


def test_a_forced_compile_short_of_memory_is_built_but_warned_about(model, monkeypatch, caplog):
    """--compile-model builds whatever the memory, as asked; where a first start's build would not fit, one
    warning says so before it starts. With the memory there, or eager, nothing is said."""
    bf16 = model.to(torch.bfloat16)
    with caplog.at_level("INFO", logger="minfer"):
        assert with_compile_choice(EngineConfig(compile_model=True), bf16).compile_model is True
        assert "may be killed" not in caplog.text
        monkeypatch.setattr(compile_choice, "available_memory", lambda device: 1)
        assert with_compile_choice(EngineConfig(compile_model=False), bf16).compile_model is False
        assert "may be killed" not in caplog.text
        assert with_compile_choice(EngineConfig(compile_model=True), bf16).compile_model is True
    (record,) = [r for r in caplog.records if "may be killed" in r.getMessage()]
    assert record.levelname == "WARNING" and "building its packages takes about" in record.getMessage()


def test_without_the_compile_cache_every_start_would_compile_so_it_stays_eager(model, amx, monkeypatch):
    monkeypatch.setenv("MINFER_CACHE", "off")
    assert "cache is off" in why_not_compiled(EngineConfig(), model.to(torch.bfloat16))


def test_build_engine_decides_before_it_prepares_the_model(tiny_checkpoint, amx, monkeypatch):
    seen = []

    def prepare(model, config):
        seen.append(config.compile_model)
        raise RuntimeError("stop here")

    monkeypatch.setattr(build, "prepare_model", prepare)
    for config, compiles in [(EngineConfig(str(tiny_checkpoint), dtype="bfloat16"), True),
                             (EngineConfig(str(tiny_checkpoint), dtype="bfloat16", compile_model=False), False)]:
        with pytest.raises(RuntimeError, match="stop here"):
            build.build_engine(config)
    assert seen == [True, False]


def test_an_engine_reports_what_it_decided(tiny_checkpoint, model):
    """/health's engine config says whether the forward runs compiled: never unset, built by the assembly or
    as the core alone."""
    assert build.build_engine(EngineConfig(str(tiny_checkpoint), num_kv_blocks=16)).engine_config.compile_model is False
    core = OnlineScheduler(model, Tokenizer.from_dir(tiny_checkpoint), num_kv_blocks=16)
    assert core.engine_config.compile_model is False
