"""Attention backends are chosen once, agree with each other, and prepare_model leaves a prepared model alone;
below the narrowest cache the tiled backend pays on, a CPU's assembled engine runs the plain one."""

from pathlib import Path

import pytest
import torch
import torch.nn as nn
from engine_checks import assert_all_free

from minfer import LLM, SamplingParams
from minfer.cpu import tiled_attention as cpu_tiled
from minfer.cpu.tiled_attention import CPUTiledBackend
from minfer.compiled.flex import FlexBackend
from minfer.attention.kv_cache import slot_of
from minfer.attention.backend import StepLayout
from minfer.attention.paged import paged_attention
from minfer.assembly.selector import choose_attention_backend
from minfer.attention.torch_sdpa import TorchBackend
from minfer.cpu.linears import packing_available
from minfer.assembly.prepare import prepare_model
from minfer.engine.config import EngineConfig
from minfer.models.gpt2 import GPT2


def test_the_backend_follows_the_device_and_the_config():
    assert type(choose_attention_backend("cpu", torch.float32, "eager")) is CPUTiledBackend
    assert type(choose_attention_backend("cpu", torch.float32, "torch")) is TorchBackend
    # built, not run: no GPU needed. FlexAttention on a GPU unless told "eager".
    assert type(choose_attention_backend("cuda", torch.bfloat16)) is FlexBackend
    assert type(choose_attention_backend("cuda", torch.bfloat16, "compiled")) is FlexBackend
    assert type(choose_attention_backend("cuda", torch.bfloat16, "eager")) is TorchBackend
    assert type(choose_attention_backend("cpu", torch.float64, kv_width=768)) is CPUTiledBackend  # auto: 16-bit only
    with pytest.raises(ValueError, match="attention_backend must be one of auto, compiled, eager"):
        choose_attention_backend("cpu", torch.float32, "flash")
    with pytest.raises(ValueError, match="runs on cpu only"):
        choose_attention_backend("cuda", torch.float32, "cpu_tiled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)])  # plain and grouped-query attention
@pytest.mark.parametrize("amx", [False, True])  # prefill chunks by matmuls, or by sdpa as on an AMX CPU
def test_cpu_and_plain_backends_compute_the_same_step(monkeypatch, dtype, heads, kv_heads, amx):
    """Padded decodes of two lengths, a fresh prompt and a continued one, through both backends."""
    monkeypatch.setattr(cpu_tiled, "cpu_has_amx", lambda: amx)
    assert CPUTiledBackend("cpu", dtype).flash_prefill == (amx and dtype != torch.float64)
    torch.manual_seed(0)
    block_size, num_blocks, D = 4, 24, 16
    tables = [[3, 17, 8, 1, 20], [5, 11], [0, 9, 14], [21, 2, 6, 13]]
    lens = [18, 6, 9, 15]  # each sequence's length once the step is done
    new = [1, 1, 9, 4]  # new tokens: two decodes, a fresh prompt, a chunk after 11 cached tokens
    starts = [0, 1, 2, 11]
    N = sum(new)
    slots = torch.cat(
        [slot_of(torch.tensor(t), torch.arange(n - k, n), block_size) for t, n, k in zip(tables, lens, new)]
    )
    layout = StepLayout(slots, starts, new, lens, tables, block_size, null_block=num_blocks)
    q, k, v = (
        torch.randn(N, heads, D, dtype=dtype),
        torch.randn(N, kv_heads, D, dtype=dtype),
        torch.randn(N, kv_heads, D, dtype=dtype),
    )
    context = torch.randn((num_blocks + 1) * block_size, 2, kv_heads, D).to(dtype)  # (num_slots, 2, Hkv, D)
    context[num_blocks * block_size :] = 0  # the null block
    outs = []
    for backend in (choose_attention_backend("cpu", dtype, "eager"), TorchBackend("cpu", dtype)):
        cache = context.clone()
        meta = backend.build_metadata(layout)
        assert meta.backend is backend and len(meta.decode_groups) == 2 and len(meta.prefills) == 2
        outs.append(paged_attention(q, k, v, cache, meta, scale=D**-0.5))
        assert torch.equal(cache[slots, 0], k) and torch.equal(cache[slots, 1], v)  # the step's keys were written
    # bf16: the CPU backend computes in fp32; float64 (the reference precision) it keeps: no fp32 rounding
    tolerance = {torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}, torch.float64: {"atol": 1e-12, "rtol": 1e-12}}
    torch.testing.assert_close(outs[0], outs[1], **tolerance.get(dtype, {}))


def test_prepare_model_is_idempotent_and_picks_the_configured_backend(tiny_checkpoint):
    model = GPT2.from_pretrained(tiny_checkpoint)
    prepared, backend = prepare_model(model, EngineConfig(attention_backend="eager"))
    assert prepared is model and type(backend) is CPUTiledBackend
    if packing_available(torch.float32):
        assert not any(type(m) is nn.Linear for m in model.modules())  # every linear packed
    modules = [(name, type(m)) for name, m in model.named_modules()]
    params = [id(p) for p in model.parameters()]
    again, other = prepare_model(model, EngineConfig(attention_backend="auto", enforce_eager=True))
    assert again is model and type(other) is CPUTiledBackend and other is not backend  # eager: a fresh one
    assert [(name, type(m)) for name, m in model.named_modules()] == modules  # nothing swapped twice
    assert [id(p) for p in model.parameters()] == params


def test_prepare_model_without_a_config_takes_the_environments_backend(tiny_checkpoint, monkeypatch):
    """No config: EngineConfig's default, which $MINFER_ATTENTION_BACKEND sets when a config is made (eager
    in tests, by conftest), not a hard-coded "auto" that would compile."""
    monkeypatch.setenv("MINFER_ATTENTION_BACKEND", "eager")
    _, backend = prepare_model(GPT2.from_pretrained(tiny_checkpoint))
    assert type(backend) is CPUTiledBackend
    monkeypatch.setenv("MINFER_ATTENTION_BACKEND", "compiled")
    assert EngineConfig().attention_backend == "compiled"
    monkeypatch.delenv("MINFER_ATTENTION_BACKEND")
    assert EngineConfig().attention_backend == "auto"


def test_the_attention_ab_script_times_each_backend(monkeypatch, capsys):
    """scripts/attention_ab.py (gpu_check.sh runs it on a GPU): each backend checked against the first, then timed."""
    import runpy
    import sys

    argv = ["attention_ab.py", "--seqs", "3", "--context", "40", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    monkeypatch.setattr(sys, "argv", [*argv, "--dtype", "float32", "--backends", "torch,cpu_tiled", "--repeats", "2"])
    runpy.run_path(str(Path(__file__).parents[2] / "scripts" / "attention_ab.py"), run_name="__main__")
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "3 sequences x 40 tokens, 4/2 heads of 16, float32, cpu:"
    for name, line in zip(("torch", "cpu_tiled"), lines[2:]):
        words = line.split()
        assert words[0] == name and float(words[1]) > 0 and words[2] == "ms" and float(words[-1].rstrip(")")) < 1e-5


def test_the_attention_ab_script_times_flex_compiled_per_shape(flex_as_on_a_gpu, monkeypatch, capsys):
    """`flex-static`: flex as a CPU compiles it (per shape), beside flex as it serves (here unfused, conftest.py)."""
    import runpy
    import sys

    from minfer.compiled import flex, flex_kernel

    monkeypatch.setattr(flex_kernel, "SERVING_DEVICES", ("cuda", "cpu"))  # "flex" compiles as on a GPU
    per_shape, build = [], flex.FlexBackend.build_metadata

    def recording(self, layout):
        per_shape.append(not self.compiles_per_shape)
        return build(self, layout)

    monkeypatch.setattr(flex.FlexBackend, "build_metadata", recording)
    argv = ["attention_ab.py", "--seqs", "3", "--context", "40", "--heads", "4", "--kv-heads", "2", "--head-dim", "16"]
    monkeypatch.setattr(sys, "argv", [*argv, "--dtype", "float32", "--backends", "torch,flex-static", "--repeats", "2"])
    monkeypatch.setattr(flex_kernel, "SERVING_BACKEND", "eager")
    runpy.run_path(str(Path(__file__).parents[2] / "scripts" / "attention_ab.py"), run_name="__main__")
    words = capsys.readouterr().out.splitlines()[3].split()
    assert words[0] == "flex-static" and words[2] == "ms" and float(words[-1].rstrip(")")) < 1e-5
    assert per_shape and all(per_shape)  # where the engine's flex compiles with dynamic shapes


def test_the_assembled_engine_runs_the_plain_backend_on_a_narrow_cache(monkeypatch, tiny_checkpoint):
    """Below MIN_CPU_KV_WIDTH a CPU runs the plain backend (measured as fast there; assembly/selector.py):
    the conftest fixture that keeps the tiled one on the tests' tiny caches is undone here."""
    from minfer.assembly import selector

    monkeypatch.setattr(selector, "MIN_CPU_KV_WIDTH", 512)
    llm = LLM(tiny_checkpoint, num_kv_blocks=16)
    assert type(llm.scheduler.attention) is TorchBackend
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)[0].token_ids
    assert_all_free(llm)
