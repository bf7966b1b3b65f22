"""EngineConfig: one list of engine settings, checked in one place, turned into the same flags for the
server, bench and generate, and reported by the server's /health as the engine runs them."""

import argparse
import sys
import threading
from dataclasses import asdict, fields

import pytest
import torch
from script_forks import run_python
from serving import ServerProcess, call

from minfer import LLM, EngineConfig, OnlineScheduler, SamplingParams
from minfer.attention.kv_cache import KVCache
from minfer.bench import cli as bench
from minfer.cpu.threads import cpu_threads_wanted
from minfer.engine.config import parse_size
from minfer.errors import InvalidParameter
from minfer.server.serve import create_server

POSITIVE_INTS = [
    "max_num_seqs",
    "max_num_batched_tokens",
    "block_size",
    "num_kv_blocks",
    "max_model_len",
    "num_threads",
]


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


# ---- every bad value names its flag ----------------------------------------------------


@pytest.mark.parametrize("name", POSITIVE_INTS)
@pytest.mark.parametrize("value", [0, -3, 1.5, True, "8"])
def test_positive_integers(name, value):
    with pytest.raises(ValueError, match=f"^{flag(name)} must be a positive integer, got {value!r}$"):
        EngineConfig(**{name: value})


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(model=""), "--model must be a checkpoint directory or Hub repo id, got ''"),
        (dict(model=7), "--model must be a checkpoint directory or Hub repo id"),
        (dict(device="gpu"), "--device must be cpu, or a CUDA device such as cuda or cuda:0, got 'gpu'"),
        (dict(device="meta"), "--device must be cpu, or a CUDA device such as cuda or cuda:0, got 'meta'"),
        (dict(device="mps"), "--device must be cpu, or a CUDA device such as cuda or cuda:0, got 'mps'"),
        (dict(dtype="int8"), "--dtype must be 'auto' or one of"),
        (dict(dtype=torch.int8), "--dtype must be 'auto' or one of"),
        (dict(seed=-1), r"--seed must be an integer in \[0, 2\*\*64\), got -1"),
        (dict(seed=2**64), "--seed must be an integer"),
        (
            dict(kv_cache_memory="2XB"),
            "--kv-cache-memory must be a size in bytes above 0, such as 2GiB, 512MiB or 1e9, got '2XB'",
        ),
        (dict(kv_cache_memory=-1), "--kv-cache-memory must be a size in bytes"),
        (dict(kv_cache_memory=0), "--kv-cache-memory must be a size in bytes above 0"),  # a flag, before the load
        (dict(kv_cache_memory=1.5), "--kv-cache-memory must be a size in bytes"),
        (dict(device="cuda", gpu_memory_utilization=0), r"--gpu-memory-utilization must be a fraction in \(0, 1\]"),
        (dict(device="cuda", gpu_memory_utilization=1.5), "--gpu-memory-utilization must be a fraction"),
        (dict(device="cuda", gpu_memory_utilization="0.5"), "--gpu-memory-utilization must be a fraction"),
        (dict(enable_prefix_caching=None), "--enable-prefix-caching must be True or False, got None"),
        (dict(enforce_eager=1), "--enforce-eager must be True or False, got 1"),
    ],
)
def test_bad_values_name_their_flag(settings, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        EngineConfig(**settings)


@pytest.mark.parametrize("variable, value", [("MINFER_DTYPE", "bogus"), ("MINFER_DEVICE", "xyz"),
                                             ("MINFER_ATTENTION_BACKEND", "fast")])
def test_a_bad_default_from_the_environment_names_its_variable(monkeypatch, variable, value):
    """No flag was given: the message points at the variable the bad value came from."""
    monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=f"^{variable} \\(the default --[a-z-]+\\) must be .*, got '{value}'"):
        EngineConfig()
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(parser)
    with pytest.raises(ValueError, match=f"^{variable} "):
        EngineConfig.from_cli_args(parser.parse_args([]))


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            dict(gpu_memory_utilization=0.5),
            "--gpu-memory-utilization .* CUDA devices only; on cpu .* --kv-cache-memory",
        ),
        (dict(num_threads=2, device="cuda"), "--num-threads sets CPU threads: it applies to --device cpu"),
        (dict(num_kv_blocks=8, kv_cache_memory="1MiB"), "--num-kv-blocks and --kv-cache-memory each set the KV"),
        (dict(device="cuda", kv_cache_memory=10, gpu_memory_utilization=0.5), "--kv-cache-memory and --gpu-memory"),
    ],
)
def test_settings_that_contradict(settings, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**settings)


def test_values_are_normalised_and_frozen(tmp_path):
    config = EngineConfig(model=tmp_path, device=torch.device("cpu"), dtype=torch.bfloat16, kv_cache_memory="2GiB")
    assert (config.model, config.device, config.dtype, config.kv_cache_memory) == (
        str(tmp_path),
        "cpu",
        "bfloat16",
        2**31,
    )
    with pytest.raises(AttributeError):
        config.block_size = 0  # checked once: it cannot go bad afterwards


def test_no_dtype_means_auto_on_a_gpu_and_fp32_on_a_cpu(monkeypatch):
    """What a GPU user expects, bf16 there; the CPU, where bf16 is fast only on some machines, stays fp32. The
    banner says which default ran. (The tests set $MINFER_DTYPE to float32, a GPU's too: their references
    are fp32.)"""
    from minfer.assembly.build import resolve_dtype
    from minfer.server.banner import dtype_reason

    monkeypatch.delenv("MINFER_DTYPE")
    assert EngineConfig().dtype is None and EngineConfig(dtype="auto").dtype == "auto"
    assert resolve_dtype(None, torch.device("cpu")) == torch.float32
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    assert resolve_dtype(None, torch.device("cuda")) == torch.bfloat16
    assert dtype_reason(None, torch.bfloat16, torch.device("cuda")).startswith("bfloat16 (the GPU's default, auto: ")
    assert dtype_reason(None, torch.float32, torch.device("cpu")).startswith("float32 (the CPU's default; ")
    monkeypatch.setenv("MINFER_DTYPE", "bfloat16")
    assert EngineConfig().dtype == "bfloat16"


def test_auto_dtype_follows_the_hardware(monkeypatch):
    from minfer.assembly import build as engine

    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: True)
    assert engine.resolve_dtype("auto") == torch.bfloat16
    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: False)
    assert engine.resolve_dtype("auto") == torch.float32
    assert engine.resolve_dtype("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="dtype must be 'auto' or one of"):
        engine.resolve_dtype("int8")


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_16_bit_dtype_the_cpu_emulates_is_warned_about(monkeypatch, caplog, tiny_checkpoint, native, dtype):
    from minfer.assembly import build as engine

    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: native)
    monkeypatch.setattr(engine, "cpu_has_native_fp16", lambda: native)
    with caplog.at_level("WARNING", logger="minfer"):
        model, _ = engine.load_for(EngineConfig(model=str(tiny_checkpoint), dtype=dtype))
    assert model.dtype == getattr(torch, dtype)
    warned = [r.getMessage() for r in caplog.records if "torch emulates it" in r.getMessage()]
    assert len(warned) == (0 if native else 1), caplog.text
    assert all(m.startswith(f"minfer: {dtype} on a CPU without it in hardware") for m in warned)


@pytest.mark.parametrize(
    "text, size",
    [("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("1e9", 10**9), ("1.5GB", 1_500_000_000), ("4096", 4096),
     (" 8 kib ", 8192), ("3b", 3), (12, 12)],
)  # fmt: skip
def test_parse_size(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["", "GiB", "2 GiBs", "-1", "1e", "nan", "0x10"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        parse_size(text)


# ---- flags: one per field, round trip ------------------------------------------------


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    EngineConfig.add_cli_arguments(p)
    return p


def test_one_flag_per_field_with_the_fields_defaults():
    args = parser().parse_args([])
    assert EngineConfig.from_cli_args(args) == EngineConfig()
    assert set(vars(args)) == {f.name for f in fields(EngineConfig)}


def test_flags_to_config_and_back():
    argv = ["--model", "m", "--device", "cpu", "--dtype", "bfloat16", "--seed", "3", "--max-num-seqs", "5",
            "--max-num-batched-tokens", "256", "--block-size", "32", "--kv-cache-memory", "512MiB",
            "--no-enable-prefix-caching", "--max-model-len", "100", "--enforce-eager", "--num-threads", "2"]  # fmt: skip
    config = EngineConfig.from_cli_args(parser().parse_args(argv))
    assert config == EngineConfig(
        model="m", dtype="bfloat16", seed=3, max_num_seqs=5, max_num_batched_tokens=256, block_size=32,
        kv_cache_memory=512 * 2**20, enable_prefix_caching=False, max_model_len=100, enforce_eager=True, num_threads=2,
    )  # fmt: skip
    again = EngineConfig.from_cli_args(parser().parse_args(config.to_cli_args(exclude=())))
    assert again == config
    assert EngineConfig(model="m").to_cli_args() == []  # defaults are not repeated; --model is the caller's


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--block-size", "0"], "--block-size must be a positive integer, got 0"),
        (["--block-size", "abc"], "--block-size must be a positive integer, got 'abc'"),
        (["--gpu-memory-utilization", "most", "--device", "cuda"], "--gpu-memory-utilization must be a fraction"),
        (["--kv-cache-memory", "2 GB of it"], "--kv-cache-memory must be a size in bytes"),
    ],
)
def test_from_cli_args_names_the_bad_flag(argv, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        EngineConfig.from_cli_args(parser().parse_args(argv))


# ---- LLM and OnlineScheduler read one config -----------------------------------------


def test_llm_config_and_keywords_are_the_same(tiny_checkpoint):
    settings = dict(block_size=32, num_kv_blocks=40, max_num_seqs=4, max_num_batched_tokens=64)
    by_keywords = LLM(tiny_checkpoint, **settings)
    by_config = LLM(config=EngineConfig(model=tiny_checkpoint, **settings))
    overridden = LLM(tiny_checkpoint, config=EngineConfig(block_size=8, num_kv_blocks=40), **settings)
    assert by_keywords.scheduler.engine_config == by_config.scheduler.engine_config
    assert overridden.scheduler.engine_config == by_config.scheduler.engine_config
    assert asdict(by_config.scheduler.engine_config) == dict(  # compile_model decided: never unset
        asdict(EngineConfig(**settings)), model=str(tiny_checkpoint), max_model_len=512, compile_model=False
    )
    assert by_config.scheduler.batcher.max_num_batched_tokens == 64 and by_config.scheduler.allocator.num_blocks == 40
    greedy = SamplingParams(max_tokens=8, temperature=0)
    assert [o.token_ids for o in by_keywords.generate(["a b c"] * 3, greedy, use_tqdm=False)] == [
        o.token_ids for o in by_config.generate(["a b c"] * 3, greedy, use_tqdm=False)
    ]
    with pytest.raises(TypeError, match="no_such_setting"):
        LLM(tiny_checkpoint, no_such_setting=1)


@pytest.fixture(scope="module")
def tiny(tiny_checkpoint):
    llm = LLM(tiny_checkpoint, num_kv_blocks=8)
    return llm.model, llm.tokenizer


def test_scheduler_keywords_over_a_config(tiny):
    sched = OnlineScheduler(*tiny, EngineConfig(block_size=32, max_num_seqs=3), num_kv_blocks=20)
    run = sched.engine_config
    assert (run.block_size, run.max_num_seqs, run.num_kv_blocks) == (32, 3, 20)
    assert sched.allocator.block_size == 32 and sched.max_num_seqs == 3
    with pytest.raises(ValueError, match="^--max-num-seqs must be a positive integer"):
        OnlineScheduler(*tiny, max_num_seqs=0)


def test_kv_cache_memory_buys_blocks_and_max_model_len_needs_fewer(tiny):
    model, tokenizer = tiny
    per_block = KVCache.bytes_per_block(model.config, 16, model.dtype)
    sched = OnlineScheduler(model, tokenizer, kv_cache_memory=40 * per_block)
    assert sched.engine_config.num_kv_blocks == 40 and sched.engine_config.kv_cache_memory is None
    with pytest.raises(ValueError, match="holds 10 blocks, fewer than the 32"):  # a 512-token context: 32 blocks
        OnlineScheduler(model, tokenizer, kv_cache_memory=10 * per_block)
    short = OnlineScheduler(model, tokenizer, kv_cache_memory=10 * per_block, max_model_len=128)
    assert short.max_model_len == 128 and short.engine_config.num_kv_blocks == 10


def test_num_kv_blocks_past_memory_is_refused_before_it_is_built(tiny, monkeypatch):
    """A billion blocks took minutes of Python objects, then the machine's memory: now one sentence, at once."""
    model, tokenizer = tiny
    per_block = KVCache.bytes_per_block(model.config, 16, model.dtype)
    with pytest.raises(ValueError, match=r"^--num-kv-blocks 1000000000 is more than the \d+ blocks"):
        OnlineScheduler(model, tokenizer, num_kv_blocks=10**9)
    monkeypatch.setattr("minfer.attention.cache_budget.available_memory", lambda device: 100 * per_block)
    with pytest.raises(ValueError, match=r"^--num-kv-blocks 101 is a .* KV cache, more than the .* free"):
        OnlineScheduler(model, tokenizer, num_kv_blocks=101)
    assert OnlineScheduler(model, tokenizer, num_kv_blocks=100).engine_config.num_kv_blocks == 100
    with pytest.raises(ValueError, match="^--num-kv-blocks 1000000000 is more"):  # before a draft's cache too
        LLM("minfer-tiny", num_kv_blocks=10**9, speculative_method="draft", speculative_model="minfer-tiny-draft")


def test_max_model_len_caps_requests(tiny):
    sched = OnlineScheduler(*tiny, num_kv_blocks=64, max_model_len=100)
    assert sched.max_model_len == sched.engine_config.max_model_len == 100
    sched.check_request([1] * 90, SamplingParams(max_tokens=10))
    with pytest.raises(InvalidParameter, match="context of 100 tokens") as refused:
        sched.check_request([1] * 90, SamplingParams(max_tokens=11))
    assert refused.value.param == "max_tokens" and refused.value.code == "context_length_exceeded"
    with pytest.raises(ValueError, match="^--max-model-len 513 exceeds the model's context of 512 tokens$"):
        OnlineScheduler(*tiny, num_kv_blocks=64, max_model_len=513)


def test_seed_makes_unseeded_sampling_repeat(tiny):
    def sampled(seed: int) -> list[int]:
        sched = OnlineScheduler(*tiny, num_kv_blocks=16, seed=seed)
        request = sched.add_request("Once upon", sampling_params=SamplingParams(max_tokens=16, ignore_eos=True))
        list(sched.steps())
        return sched.pop_response(request).token_ids

    assert sampled(7) == sampled(7) != sampled(8)


# ---- the server and bench ------------------------------------------------------------


def test_in_process_server_reports_its_engine_in_health(tiny_checkpoint):
    config = EngineConfig(model=str(tiny_checkpoint), block_size=32, max_num_batched_tokens=256, num_kv_blocks=40)
    srv = create_server(config, port=0)
    threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    try:
        status, _, health = call(srv.server_address[1], "GET", "/health", headers={})
    finally:
        srv.stop(grace=1.0)
    assert status == 200 and health["status"] == "ok"
    assert health["engine"] == {
        "device": "cpu",
        "dtype": "float32",
        "seed": 0,
        "max_num_seqs": 64,
        "max_num_batched_tokens": 256,
        "block_size": 32,
        "num_kv_blocks": 40,
        "kv_cache_memory": None,
        "gpu_memory_utilization": None,
        "enable_prefix_caching": True,
        "max_model_len": 512,
        "attention_backend": "eager",  # what runs: the tests' default (conftest.py)
        "enforce_eager": False,
        "compile_decode_step": False,
        "compile_model": False,
        "num_threads": cpu_threads_wanted(),  # the count it runs (conftest.py's MINFER_NUM_THREADS), never null
        "generation_config": "auto",
        "quantization": None,
        "quantization_group_size": None,
        "quantize_lm_head": True,
        "quantize_activations": False,
        "speculative_method": None,
        "num_speculative_tokens": None,
        "ngram_min": None,
        "ngram_max": None,
        "speculative_model": None,
    }


def test_serve_command_reports_its_flags_in_health(tiny_checkpoint, tmp_path):
    srv = ServerProcess(tiny_checkpoint, tmp_path / "server.log", "--block-size", "32", "--max-num-batched-tokens",
                        "256", "--num-kv-blocks", "40", "--no-enable-prefix-caching")  # fmt: skip
    try:
        status, _, health = call(srv.port, "GET", "/health", headers={})
    finally:
        srv.stop()
    engine = health["engine"]
    assert status == 200 and (engine["block_size"], engine["max_num_batched_tokens"]) == (32, 256)
    assert engine["num_kv_blocks"] == 40 and engine["enable_prefix_caching"] is False


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--block-size", "x"], "error: --block-size must be a positive integer, got 'x'"),
        (["--gpu-memory-utilization", "0.5"], "error: --gpu-memory-utilization is a share of GPU memory"),
    ],
)
def test_serve_refuses_a_bad_flag_in_one_line(tiny_checkpoint, argv, message):
    cmd = [sys.executable, "-m", "minfer.serve", "--model", str(tiny_checkpoint), "--port", "0", *argv]
    done = run_python(cmd, timeout=120)  # in a fork of a process that has imported torch
    assert done.returncode == 2 and done.stdout == ""  # a bad flag: argparse's status
    assert done.stderr.startswith(message) and done.stderr.count("\n") == 1, done.stderr


def test_bench_engine_flags(tiny_checkpoint, capsys):
    args = bench.parse_args(["--model", str(tiny_checkpoint), "--block-size", "32", "--no-enable-prefix-caching"])
    config = EngineConfig.from_cli_args(args)
    assert config.block_size == 32 and not config.enable_prefix_caching and config.dtype == "float32"
    assert config.to_cli_args() == ["--block-size", "32", "--no-enable-prefix-caching"]  # what online mode passes
    with pytest.raises(SystemExit) as e:  # judged with the other flags, before anything loads
        bench.main(["--model", str(tiny_checkpoint), "--kv-cache-memory", "lots"])
    err = capsys.readouterr().err
    assert e.value.code == 2
    assert err.startswith("python bench.py: error: --kv-cache-memory must be a size") and err.count("\n") == 1


def test_no_quantize_lm_head_without_quantization_is_refused():
    with pytest.raises(ValueError, match=r"--no-quantize-lm-head applies with --quantization only \(nothing is quantized\)"):
        EngineConfig(quantize_lm_head=False)
    assert EngineConfig(quantization="int8", quantize_lm_head=False).quantize_lm_head is False
