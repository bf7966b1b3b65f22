"""--compile-decode-step: all-decode steps through the compiled block graph (or, with --compile-model,
most steps through the whole forward with frozen weights) give eager's tokens, never recompile while serving, and fall back
to eager when compiling fails."""

import gc
import json
import logging
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch._dynamo
from engine_checks import generate_varied_batches

from minfer import LLM, EngineConfig, SamplingParams
from minfer.assembly import compile_choice
from minfer.compiled import packaged
from minfer.compiled import step as compiled_step
from minfer.cpu import linears as cpu_linears
from minfer.cpu import malloc
from minfer.cpu.packing import SplitRowLinear
from minfer.compiled.step import CompiledDecodeStep, _placeholder_sequence, frozen_gemm_backends
from minfer.engine.sequence import ScheduledChunk
from minfer.quantization import QuantizedLinear, int4_kernel_available
from minfer.server.banner import banner_lines

GREEDY = SamplingParams(temperature=0, max_tokens=24)


def prompts_with_a_shared_prefix(seed=1, num=20):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, 300, (40,), generator=g).tolist()
    return [shared + torch.randint(0, 300, (int(n),), generator=g).tolist() for n in torch.randint(1, 90, (num,))]


def graph_of(llm: LLM) -> CompiledDecodeStep:
    return llm.scheduler.runner.compiled.step


@pytest.mark.parametrize("preset, attention", [("tiny", "eager"), ("qwen3-tiny", "compiled")])  # each model, each backend
def test_greedy_output_equals_eager(make_checkpoint, preset, attention, monkeypatch):
    """fp32: batching, chunked prefill, prefix hits and preemption, with and without the compiled step. GPT-2's
    lone row on split copies of its packed linears (cpu/packing.py), as a large model runs it; Qwen3's on the packed op."""
    if preset == "tiny":
        monkeypatch.setattr(cpu_linears, "one_row_parts", lambda model, dtype: 2)
    path = make_checkpoint(preset)
    prompts = prompts_with_a_shared_prefix()
    settings = dict(num_kv_blocks=40, max_num_seqs=16, max_num_batched_tokens=64, attention_backend=attention)
    compiled = LLM(path, compile_decode_step=True, **settings)
    # A mixed load (where prefill chunks share most steps), then a batch whose prompts fit one step (every
    # later step decodes all four) and a lone sequence: each graph surely serves.
    workloads = [prompts, [p[:3] for p in prompts[:4]], prompts[:1]]
    got = [o.token_ids for w in workloads for o in compiled.generate(w, GREEDY, use_tqdm=False)]
    stats = compiled.stats()
    assert stats["num_preemptions"] > 0 and stats["recompute_cache_hit_tokens"] > 0
    step = graph_of(compiled)
    assert step.off_because is None and step.compiled_batches == {True, False}  # both graphs served
    assert (preset == "tiny") == any(type(m) is SplitRowLinear for m in compiled.model.modules())
    eager = LLM(path, **settings)
    assert got == [o.token_ids for w in workloads for o in eager.generate(w, GREEDY, use_tqdm=False)]


def test_int8_activations_and_speculation_equal_eager(tiny_checkpoint):
    """int8 x int8's activation rounding fuses into the graph, and n-gram verification rows (all-decode
    steps of k + 1 rows a sequence) run through it: still eager's tokens."""
    g = torch.Generator().manual_seed(3)
    passages = [torch.randint(0, 400, (int(n),), generator=g).tolist() for n in (30, 55, 80)]
    prompts = [p + p[:10] for p in passages]  # a passage, then its first tokens again
    settings = dict(quantization="int8", quantize_activations=True, num_kv_blocks=64,
                    speculative_method="ngram", num_speculative_tokens=4, ngram_min=1, ngram_max=3)
    compiled = LLM(tiny_checkpoint, compile_decode_step=True, **settings)
    got = compiled.generate(prompts, GREEDY, use_tqdm=False)
    assert compiled.stats()["spec_decode_num_accepted_tokens"] > 0
    assert graph_of(compiled).off_because is None and graph_of(compiled).compiled_batches
    want = LLM(tiny_checkpoint, **settings).generate(prompts, GREEDY, use_tqdm=False)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_warm_up_compiles_both_graphs_and_serving_never_recompiles(tiny_checkpoint):
    """The engine compiles a lone sequence's graph and a batch's before its first request; after that
    (dynamic=True) no batch size or context length recompiles."""
    torch._dynamo.reset()
    llm = LLM(tiny_checkpoint, compile_decode_step=True, attention_backend="compiled", num_kv_blocks=64,
              max_num_seqs=8)
    step = graph_of(llm)
    assert step.compiled_batches == {True, False} and step.warm_up_seconds > 0  # before any request
    # Every layer shares the block's two graphs (a lone sequence's, a batch's): none per layer.
    assert len(step.layers) > 1 and len(step.graph.graphs) == 2
    assert llm.scheduler.engine_config.compile_decode_step is True
    assert "; decode steps compiled, graphs " in "\n".join(banner_lines(llm.scheduler, "auto", "-", False))
    with torch._dynamo.config.patch(error_on_recompile=True):  # see test_compiled_attention's twin
        generate_varied_batches(llm)
    assert step.off_because is None  # a recompile would have turned it off


@pytest.mark.parametrize("flag", ["compile_decode_step", "compile_model"])
def test_falls_back_to_eager_when_compiling_fails(tiny_checkpoint, monkeypatch, caplog, flag):
    """A compile that fails at start-up, or later, leaves the engine running eager, with one log line
    (under --compile-model, on the plain linears it kept for the graph)."""

    def broken(*args):
        raise RuntimeError("no C++ compiler found")

    monkeypatch.setattr(torch, "compile", lambda fn, **options: broken)
    monkeypatch.setenv("MINFER_CACHE", "off")  # compiled by torch.compile, not loaded from an earlier test's
    with caplog.at_level(logging.WARNING, logger="minfer"):
        llm = LLM(tiny_checkpoint, num_kv_blocks=32, **{flag: True})
    step = graph_of(llm)
    assert "compiled decode step is off" in caplog.text and "no C++ compiler found" in caplog.text
    assert step.off_because.startswith("RuntimeError") and step.warm_up_seconds is None
    ran = llm.scheduler.engine_config  # what /health reports
    assert ran.compile_decode_step is False and ran.compile_model is False
    banner = "\n".join(banner_lines(llm.scheduler, "auto", "-", False))
    assert "; decode step eager (its compile failed: RuntimeError: no C++ compiler found)" in banner
    got = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
    assert got == LLM(tiny_checkpoint, num_kv_blocks=32).generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids


def test_the_whole_forward_compiled_in_memory_is_compiled_again_without_epilogue_fusion(tiny_checkpoint, monkeypatch,
                                                                                          caplog):
    """Where Inductor fails on the whole forward compiled in memory (the cache off), it is compiled once more without
    epilogue fusion, as packaged.py's `_built` builds a package again: torch 2.13 asserted so ("buf22") for Llama
    with int4 weights. Here the first compile fails alike, the second stands in for Inductor by running eager."""
    from torch._inductor.exc import InductorError

    compiles = []

    def compile(fn, **kwargs):
        compiles.append(kwargs["options"])
        if kwargs["options"].get("epilogue_fusion") is not False:
            def fails(*args):
                raise InductorError(AssertionError("buf22"), None)
            return fails
        return fn

    monkeypatch.setattr(torch, "compile", compile)
    monkeypatch.setenv("MINFER_CACHE", "off")
    with caplog.at_level(logging.WARNING, logger="minfer"):
        llm = LLM(tiny_checkpoint, num_kv_blocks=32, compile_model=True)
    step = graph_of(llm)
    assert "compiling the whole forward again without epilogue fusion" in caplog.text
    assert step.off_because is None and step.fusion_off and len(compiles) == 2
    assert compiles[1] == {**compiles[0], "epilogue_fusion": False}  # nothing else changed
    got = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
    assert step.off_because is None and step.num_whole_steps > 0
    assert got == LLM(tiny_checkpoint, num_kv_blocks=32).generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids


def test_whole_graph_with_frozen_weights_equals_eager(make_checkpoint):
    """--compile-model: the whole forward, its weights frozen in for Inductor's own GEMMs, serving decode,
    prefill and mixed steps (a lone sequence's prefill runs eager). fp32 greedy tokens equal eager's under
    batching, chunked prefill, prefix hits and preemption; no batch size, token count or context length
    recompiles after warm-up; the linears stay plain, for Inductor to pack."""
    path = make_checkpoint("qwen3-tiny")
    prompts = prompts_with_a_shared_prefix(seed=2)
    settings = dict(num_kv_blocks=40, max_num_seqs=16, max_num_batched_tokens=64, attention_backend="compiled")
    torch._dynamo.reset()
    compiled = LLM(path, compile_model=True, **settings)
    step = graph_of(compiled)
    assert step.whole and step.compiled_batches == {True, False} and step.warm_up_seconds > 0
    ran = compiled.scheduler.engine_config
    assert ran.compile_model is True and ran.compile_decode_step is False
    assert "; steps compiled whole, weights frozen, graphs " in "\n".join(banner_lines(compiled.scheduler, "auto", "-", False))
    linears = [m for m in step.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all(type(m) is torch.nn.Linear for m in linears)  # none prepacked by oneDNN
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = [o.token_ids for o in compiled.generate(prompts, GREEDY, use_tqdm=False)]
        generate_varied_batches(compiled)
    assert step.off_because is None
    stats = compiled.stats()
    assert stats["num_preemptions"] > 0 and stats["recompute_cache_hit_tokens"] > 0
    eager = LLM(path, **settings)
    assert got == [o.token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]

    # A lone sequence: its prompt goes through the batch graph (its sampled row padded to two), and its
    # decode's attention is traced into the lone graph, packaged or not, so the backend's own forward runs for
    # the prompt's layers only, never for a decode step, as contexts grow across blocks (14 + 40 tokens). A
    # one-token prompt is laid out as a decode, and runs there too. Two completions forking from one (one row,
    # two sampled) run eager: no third graph.
    backend = compiled.scheduler.runner.attention
    assert backend.lone_decode_in_graph and not eager.scheduler.runner.attention.lone_decode_in_graph
    calls = []  # the rows of each layer's call of the backend's forward
    backend.forward = lambda *args: calls.append(args[0].shape[0]) or type(backend).forward(backend, *args)
    lone = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    layers = step.model.config.num_layers
    eager_steps = step.num_eager_steps
    with torch._dynamo.config.patch(error_on_recompile=True):
        got = compiled.generate([prompts[0][:14]], lone, use_tqdm=False)[0].token_ids
        assert calls == [14] * layers and step.num_eager_steps == eager_steps
        calls.clear()
        one = compiled.generate([prompts[2][:1]], lone, use_tqdm=False)[0].token_ids
        assert calls == [] and step.num_eager_steps == eager_steps
        assert one == eager.generate([prompts[2][:1]], lone, use_tqdm=False)[0].token_ids
        forks = compiled.generate([prompts[1][:1]], SamplingParams(n=2, max_tokens=3, seed=3), use_tqdm=False)
        assert calls[:layers] == [1] * layers and len(forks) == 2  # the prompt eager; then two rows, in the op
        assert step.num_eager_steps == eager_steps + 1
    assert step.off_because is None
    assert got == eager.generate([prompts[0][:14]], lone, use_tqdm=False)[0].token_ids


def test_the_whole_forward_is_packaged_once_and_loaded_after(make_checkpoint):
    """--compile-model's packages (packaged.py): a start after the first loads both from the cache, in seconds,
    and serves what eager serves."""
    path = make_checkpoint("qwen3-tiny")
    settings = dict(num_kv_blocks=40, max_num_seqs=16, max_num_batched_tokens=64, attention_backend="compiled")
    LLM(path, compile_model=True, **settings)  # compiles them, unless the test above did
    compiled = LLM(path, compile_model=True, **settings)
    step = graph_of(compiled)
    assert step.packaged is not None and step.compile_record.how == "loaded" and step.compile_record.num_loaded == 2
    entry = step.compile_record.path
    assert {p.suffix for p in entry.parent.glob(entry.stem + ".*") if p.is_dir()} == {".lone", ".batch"}  # unpacked
    libraries = [so.name for kind in ("lone", "batch") for so in entry.with_name(f"{entry.stem}.{kind}").rglob("*.so")]
    assert libraries and not [p for name in libraries for p in entry.parents[1].glob(f"inductor/*/{name}")]  # once
    for kind in ("lone", "batch"):  # the code each export ran, to build it again once that changes (_usable)
        traced = json.loads((entry.with_name(f"{entry.stem}.{kind}") / packaged.TRACED).read_text())
        assert {"models/llama.py", "attention/paged.py"} <= {"/".join(Path(f).parts[-2:]) for f in traced}, traced
    # one copy of the weights in memory: the batch package reads the lone one's constants (shared_constants.py),
    # unless timing chose ATen's GEMM for some layer (oneDNN packs that weight its own way): then all its own
    lone, batch = step.packaged.lone.constants(), step.packaged.batch.constants()
    packed = {name for name, t in batch.items() if t.layout != torch.strided}
    plain = {t.data_ptr() for name, t in batch.items() if name not in packed}
    lone_plain = {t.data_ptr() for t in lone.values() if t.layout == torch.strided}
    assert lone and batch and plain
    if not packed:  # as the first start recorded: the batch package's own copy was never read, and is gone
        assert plain <= lone_plain
        assert step.packaged.batch.shared_by == "record" and step.packaged.batch.blob is None
        assert not list(entry.with_name(f"{entry.stem}.batch").rglob("*.blob"))
    else:  # as recorded: the batch package reads its own file, and shares nothing
        assert not plain & lone_plain and step.packaged.batch.blob.is_file()
        assert step.packaged.batch.shared_by is None and not step.packaged.batch.kept
    assert step.packaged.lone.blob.is_file() and not step.packaged.lone.kept  # the lone package reads its own
    maps = Path("/proc/self/maps").read_text() if Path("/proc/self/maps").exists() else ""
    assert str(step.packaged.lone.blob.resolve()) not in maps  # copied in, its file's pages not kept
    prompts = prompts_with_a_shared_prefix(seed=4)
    got = [o.token_ids for o in compiled.generate(prompts, GREEDY, use_tqdm=False)]
    assert got == [o.token_ids for o in LLM(path, **settings).generate(prompts, GREEDY, use_tqdm=False)]
    assert step.off_because is None
    # bench.py --profile: the linears ran inside the graph, where no hook times them; it says so
    from minfer.bench.profile import format_profile, profile_steps
    from minfer.bench.workload import BenchRequest

    requests = [BenchRequest(i, None, list(range(1, 9 + i)), 8 + i, 12, 0.0) for i in range(4)]
    profile = profile_steps(compiled.scheduler, requests, num_steps=3)
    assert profile["phases"]["decode"]["whole_steps"] == 3
    assert "3 of them ran the whole forward compiled (--compile-model)" in format_profile(profile)

    # A lone decode through its package (attention traced in), before anything else wrote the step's K/V:
    # every layer's keys and values land where eager puts them, and the logits are eager's.
    runner, kv = compiled.scheduler.runner, compiled.scheduler.runner.kv_cache.kv
    kv.normal_()
    kv[:, runner.kv_cache.null_block].zero_()
    with torch.inference_mode():
        rows = runner.prepare([ScheduledChunk(_placeholder_sequence(5, runner.block_size), 4, 1)])
        batch, before = runner.batch(rows), kv.clone()
        got = step(rows.input_ids, batch)
        written = kv.clone()
        kv.copy_(before)
        want = runner.model(rows.input_ids, batch)
    assert (written != before).flatten(1).any(1).all()  # each layer
    torch.testing.assert_close(written, kv)
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_whole_graph_quantized_step_matches_eager(tiny_checkpoint, method, monkeypatch):
    """Quantized linears in the frozen graph: every row count goes through the kernel's op, which Inductor
    lowers to a GEMM of its own (it rounds differently: bf16 rows, its own order), so a decode step's
    logits match eager's within bf16's rounding rather than bit for bit; a lone sequence and a batch.
    Compiled in memory (the cache off): building packages would double the test's time."""
    if method == "int4" and not int4_kernel_available():
        pytest.skip("this torch has no CPU int4 kernel")
    monkeypatch.setenv("MINFER_CACHE", "off")
    llm = LLM(tiny_checkpoint, compile_model=True, quantization=method, num_kv_blocks=32)
    step, runner = graph_of(llm), llm.scheduler.runner
    assert step.off_because is None and step.compiled_batches == {True, False}
    quantized = [m for m in step.model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(m.kernel_when_compiled for m in quantized)
    runner.kv_cache.kv.zero_()  # the placeholders' contexts all lie in block 0, read before most is written
    for contexts in ((5,), (5, 9, 17, 33) * 5):  # 20 rows: above int8's kernel_max_rows, eager dequantizes
        chunks = [ScheduledChunk(_placeholder_sequence(n, runner.block_size), n - 1, 1) for n in contexts]
        with torch.inference_mode():
            rows = runner.prepare(chunks)
            input_ids, batch = rows.input_ids, runner.batch(rows)
            want = runner.model(input_ids, batch)  # (S, V)
            got = step(input_ids, batch)
        assert step.off_because is None and got.shape == want.shape
        torch.testing.assert_close(got, want, rtol=0, atol=0.03 * want.abs().max().item())
        assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("amx, dtype, quantize, want", [
    (True, torch.bfloat16, False, "CPP"),
    (True, torch.float32, True, "CPP"),  # no float GEMM left: every linear and the head are quantized
    (True, torch.float32, False, "CPP,ATEN"),  # oneDNN's fp32 GEMM won at 16 rows
    (False, torch.bfloat16, False, "CPP,ATEN"),  # templates alone: measured on AMX only
])
def test_frozen_graph_gemm_choices_follow_the_cpu_and_the_weights(monkeypatch, amx, dtype, quantize, want):
    from minfer.quantization.transform import quantized_linear

    monkeypatch.setattr(compiled_step, "cpu_has_amx", lambda: amx)
    linears = [torch.nn.Linear(64, 32, dtype=dtype), torch.nn.Linear(32, 16, dtype=dtype)]
    model = torch.nn.Sequential(*(quantized_linear(m, "int8") if quantize else m for m in linears))
    assert frozen_gemm_backends(model) == want


@pytest.mark.parametrize("settings, message", [
    (dict(compile_decode_step=True, enforce_eager=True), "--enforce-eager never does"),
    (dict(compile_decode_step=True, device="cuda"), "for --device cpu for now"),
    (dict(compile_model=True, enforce_eager=True), "--enforce-eager never does"),
    (dict(compile_model=True, device="cuda"), "for --device cpu for now"),
    (dict(compile_model=True, compile_decode_step=True), "give one"),
    (dict(attention_backend="compiled", enforce_eager=True), "--enforce-eager never does"),
    (dict(compile_model=True, quantization="int8", quantize_activations=True), "does not compile under --compile-model"),
])
def test_refused_where_it_cannot_apply(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="minfer-tiny", **settings)


LONE_INT4 = dict(quantization="int4", num_kv_blocks=40, max_num_seqs=4)


@pytest.fixture(scope="module")
def lone_int4_llama(make_checkpoint):
    """Llama with int4 weights, --compile-model on a CPU with AVX2 alone, whose lone decode alone is packaged
    (assembly/compile_choice.py), built afresh once for the tests below in a cache of their own (whose Inductor
    kernels stay from the last run's build: 30 s instead of 55, the package still built twice): the LLM, the
    glibc mmap threshold each build of a package ran with, the last one set, and the frozen graph modules alive
    after the start."""
    if not int4_kernel_available():
        pytest.skip("this torch has no CPU int4 kernel")
    mmap_threshold, thresholds_in_builds = [None], []
    mallopt = malloc.glibc_mallopt()

    def recorded_mallopt(param, value):
        if param == malloc.M_MMAP_THRESHOLD:
            mmap_threshold[0] = value
        return mallopt(param, value) if mallopt is not None else 1

    def build(*args):
        thresholds_in_builds.append(mmap_threshold[0])
        return plain_build(*args)

    plain_build = packaged._build
    with pytest.MonkeyPatch.context() as patch:
        cache = Path(os.environ["MINFER_CACHE"]) / "lone-int4"
        shutil.rmtree(cache / "entries", ignore_errors=True)  # no package to load: it is built
        patch.setenv("MINFER_CACHE", str(cache))
        patch.setattr(compile_choice, "cpu_has_amx", lambda: False)
        patch.setattr(compile_choice, "cpu_has_native_bf16", lambda: False)  # AVX2 alone: fp32 activations
        patch.setattr(malloc, "glibc_mallopt", lambda: recorded_mallopt)
        patch.setattr(packaged, "_build", build)
        llm = LLM(make_checkpoint("llama-tiny"), compile_model=True, **LONE_INT4)
        modules = [m for m in gc.get_objects() if isinstance(m, torch.nn.Module)]
        frozen = [m for m in modules if any(name.startswith("_frozen_param") for name in m._buffers)]
    return llm, thresholds_in_builds, mmap_threshold[0], frozen


def test_llama_with_int4_weights_is_packaged(lone_int4_llama):
    """torch 2.13's C++ codegen asserts on a fused buffer ("buf22") for Llama with int4 weights; the package is
    built again without epilogue fusion (packaged.py's `_built`, which logs it), and the step serves through it.
    Each build runs with glibc returning what it frees (malloc.py): its copies of the weights do not stay, and
    no graph of the build keeps any (packaged.py's `_forget_export_trace`)."""
    llm, thresholds_in_builds, last_threshold, frozen = lone_int4_llama
    step = graph_of(llm)
    assert step.off_because is None and step.packaged is not None and step.compile_record.how == "compiled"
    assert len(thresholds_in_builds) >= 2 and set(thresholds_in_builds) == {malloc.WHILE_LOADING}
    assert last_threshold == malloc.AFTER_LOADING  # and steps reuse the heap after
    # nor does the exported graph, whose module holds frozen copies of the weights: freed by the build itself
    assert not frozen, [type(m).__name__ for m in frozen]


def test_without_amx_quantized_weights_package_the_lone_decode_alone(lone_int4_llama, make_checkpoint):
    """Where a quantized model's batch package lost to eager (int8 and int4 on AVX512-BF16 or AVX2 without AMX:
    assembly/compile_choice.py), only a lone sequence's decode is packaged and compiled; batches and prefill run
    eager, and serve what eager serves."""
    llm = lone_int4_llama[0]
    step = graph_of(llm)
    assert step.lone_only and step.off_because is None and step.packaged is not None and step.packaged.batch is None
    entry = step.compile_record.path
    assert {p.suffix for p in entry.parent.glob(entry.stem + ".*") if p.is_dir()} == {".lone"}
    whole = step.num_whole_steps
    alone = llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0]
    assert step.num_whole_steps - whole == GREEDY.max_tokens - 1  # every decode; the prompt ran eager
    whole, eager_steps = step.num_whole_steps, step.num_eager_steps
    batch = llm.generate([[5, 6, 7], [9, 10, 11, 12]], GREEDY, use_tqdm=False)
    assert step.num_whole_steps == whole and step.num_eager_steps > eager_steps  # batches eager
    eager = LLM(make_checkpoint("llama-tiny"), compile_model=False, **LONE_INT4)
    assert batch[0].token_ids == alone.token_ids == eager.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].token_ids
