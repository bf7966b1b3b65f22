"""A fallback at every step only a GPU runs (compiled/forward.py), each failure injected on the CPU into the GPU
path as conftest.py's flex_traced_as_on_a_gpu runs it: flex compiled per kind of step and sealed, decode steps
through the (unrecorded) CUDA graphs. Each leaves a working engine with the same greedy tokens as
--enforce-eager, one log line, and says what runs (stats: /metrics and /health)."""

import http.client
import json
import logging
import random
import signal
import threading
import time

import pytest
import torch
from serving import serving
from engine_checks import assert_all_free

from minfer import LLM, SamplingParams
from minfer.compiled import cuda_graphs, flex, warm_up
from minfer.compiled.cuda_graphs import DecodeGraphs
from minfer.compiled.paged_op import OpaqueAttention
from minfer.compiled.step import CompiledDecodeStep
from minfer.engine.config import EngineConfig
from minfer.server import prometheus
from minfer.server.metrics import Metrics

STICKY = "CUDA error: an illegal memory access was encountered"
GREEDY = SamplingParams(max_tokens=12, temperature=0)


def prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(512) for _ in range(rng.randrange(3, 60))] for _ in range(5)]


@pytest.fixture(scope="module")
def expected(tiny_checkpoint):
    """What --enforce-eager generates: the reference every fallback must match."""
    llm = LLM(tiny_checkpoint, num_kv_blocks=64, enforce_eager=True)
    return [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


@pytest.fixture
def gpu_like(flex_traced_as_on_a_gpu, monkeypatch, tiny_checkpoint):
    """An engine built as on a GPU: flex serving, and decode graphs (not recorded on a CPU)."""
    monkeypatch.setattr(
        cuda_graphs, "wants_decode_graphs", lambda device, eager, backend: not eager and backend.captures_in_graphs
    )
    return lambda **settings: LLM(tiny_checkpoint, num_kv_blocks=64, max_num_seqs=5, attention_backend="auto", **settings)


def generate(llm) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(prompts(), GREEDY, use_tqdm=False)]


def post(port: int, path: str, body: dict) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("POST", path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    status = conn.getresponse().status
    conn.close()
    return status


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "minfer"]


def test_the_gpu_path_as_built(gpu_like, expected, caplog):
    """Nothing injected: flex warmed up and sealed, graphs serving, no fallback, the eager engine's tokens."""
    llm = gpu_like()
    compiled = llm.scheduler.runner.compiled
    assert compiled.sealed and compiled.graphs is not None and compiled.attention.name == "flex"
    assert generate(llm) == expected and compiled.graphs.num_steps > 0
    assert llm.stats()["num_path_fallbacks"] == 0 and not warnings(caplog)


def test_capture_failure_leaves_eager_decode_steps(gpu_like, expected, monkeypatch, caplog):
    def fail(graphs):
        graphs.graphs[1] = None  # something was recorded before the failure: it is released
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(DecodeGraphs, "capture_all", fail)
    llm = gpu_like()
    compiled = llm.scheduler.runner.compiled
    assert compiled.graphs is None and compiled.sealed  # flex still serves eager steps, compiled
    assert warnings(caplog) == ["minfer: CUDA graphs off, running eager instead: capture failed: RuntimeError: "
                                "operation not permitted when stream is capturing"]
    assert generate(llm) == expected
    stats = llm.stats()
    assert stats["num_path_fallbacks"] == 1 and stats["compiled_paths"]["cuda_graphs"] == "off"
    assert "off, running eager: CUDA graphs: capture failed" in compiled.describe()
    assert_all_free(llm)


@pytest.mark.parametrize("failure", ["raises", "differs"])
def test_flex_compile_failure_or_mismatch_at_warm_up_runs_the_plain_backend(gpu_like, expected, monkeypatch, caplog,
                                                                            failure):
    def compile_fails(dynamic):
        def compiled(*args, **kwargs):
            raise RuntimeError("triton: out of resources")

        return compiled

    if failure == "raises":
        monkeypatch.setattr(flex, "compiled_flex_attention", compile_fails)
    else:
        monkeypatch.setattr(flex.FlexBackend, "_check", lambda self, *shape: "its results differ by 0.3")
    llm = gpu_like()
    assert llm.scheduler.attention.name != "flex" and llm.scheduler.runner.compiled is None
    assert llm.scheduler.engine_config.attention_backend == "eager"
    (line,) = warnings(caplog)
    assert line.startswith("minfer: compiled attention is off, running eager attention instead: ")
    assert ("out of resources" if failure == "raises" else "differ by 0.3") in line
    assert generate(llm) == expected


def test_warm_up_over_its_budget_runs_the_plain_backend(gpu_like, expected, monkeypatch, caplog):
    monkeypatch.setattr(warm_up, "WARM_UP_BUDGET_S", 0.2)
    monkeypatch.setattr(warm_up, "_run_step", lambda *args: time.sleep(0.3))  # a compile that takes too long
    llm = gpu_like()
    compiled = llm.scheduler.runner.compiled
    assert compiled.attention.name == "torch" and not compiled.sealed and compiled.graphs is None
    assert llm.scheduler.engine_config.attention_backend == "eager"
    assert warnings(caplog) == [
        "minfer: flex attention off, running eager instead: its warm-up failed: compiling took longer than its 0 s budget"
    ]
    assert generate(llm) == expected
    assert llm.stats()["compiled_paths"]["attention"] == "torch"


def test_graph_replay_that_raises_mid_run_switches_graphs_off(gpu_like, expected, caplog):
    llm = gpu_like()
    compiled = llm.scheduler.runner.compiled
    graphs, real_run = compiled.graphs, compiled.graphs.run

    def fails_once(*args):
        graphs.run = real_run
        raise RuntimeError("CUDA graph replay failed")

    graphs.run = fails_once
    assert generate(llm) == expected  # the failed step ran again, eagerly, on flex
    assert compiled.graphs is None and compiled.attention.name == "flex" and not graphs.graphs  # released
    assert warnings(caplog) == [
        "minfer: CUDA graphs off, running eager instead: it raised mid-run: RuntimeError: CUDA graph replay failed"
    ]
    stats = llm.stats()
    assert stats["num_path_fallbacks"] == 1
    assert "minfer_path_fallbacks_total 1" in prometheus.render(Metrics(), stats).splitlines()
    assert_all_free(llm)


def test_recompile_after_warm_up_switches_flex_off(flex_traced_as_on_a_gpu, tiny_checkpoint, expected, monkeypatch,
                                                    caplog):
    """A kind of step the warm-up missed (here: new kernel options) would compile mid-run: sealed, it raises
    instead, and flex gives way to the plain backend, never to a silent unfused run."""
    llm = LLM(tiny_checkpoint, num_kv_blocks=64, attention_backend="auto")
    compiled, compiles = llm.scheduler.runner.compiled, len(flex_traced_as_on_a_gpu)
    monkeypatch.setattr(flex, "kernel_options", lambda query_len, key_block: {"BLOCK_M": 32, "BLOCK_N": 16})
    assert generate(llm) == expected
    assert compiled.attention.name == "torch" and len(flex_traced_as_on_a_gpu) == compiles
    (line,) = warnings(caplog)
    assert line.startswith("minfer: flex attention off, running eager instead: it raised mid-run: RuntimeError: "
                           "Detected recompile when torch.compile stance is 'fail_on_recompile'")
    assert llm.stats()["num_path_fallbacks"] == 1


def test_compiled_step_that_raises_mid_run_runs_eager(tiny_checkpoint, expected, monkeypatch, caplog):
    def raises(self, input_ids, paged):
        raise RuntimeError("inductor: C++ compile failed")

    monkeypatch.setattr(CompiledDecodeStep, "warm_up", lambda self, runner: None)
    monkeypatch.setattr(CompiledDecodeStep, "__call__", raises)
    llm = LLM(tiny_checkpoint, num_kv_blocks=64, compile_decode_step=True)
    assert generate(llm) == expected
    assert warnings(caplog) == ["minfer: the compiled decode step off, running eager instead: it raised mid-run: "
                                "RuntimeError: inductor: C++ compile failed"]
    assert llm.stats()["compiled_paths"]["compiled_step"] == "off"


def test_compiled_step_whose_compile_fails_mid_run_is_counted(tiny_checkpoint, expected, monkeypatch, caplog):
    """The compiled step catches its own compile failure and runs the step eagerly (step.py): one log line, its
    own, and one more count."""
    monkeypatch.setattr(CompiledDecodeStep, "warm_up", lambda self, runner: None)
    llm = LLM(tiny_checkpoint, num_kv_blocks=64, compile_decode_step=True)
    step = llm.scheduler.runner.compiled.step
    step.opaque = OpaqueAttention(llm.scheduler.attention)  # what its warm-up sets up, compiling nothing

    def graph(*args, **kwargs):
        raise RuntimeError("inductor: C++ compile failed")

    step.graph = graph
    lone = llm.generate(prompts()[:1], GREEDY, use_tqdm=False)  # one sequence: its decode steps take the graph
    assert lone[0].token_ids == expected[0]
    assert warnings(caplog) == ["minfer: the compiled decode step is off, running eager instead: RuntimeError: "
                                "inductor: C++ compile failed"]
    assert llm.stats()["num_path_fallbacks"] == 1


def test_a_sticky_cuda_error_is_not_retried(gpu_like):
    llm = gpu_like()
    compiled = llm.scheduler.runner.compiled

    def sticky(*args):
        raise torch.AcceleratorError(STICKY)

    compiled.graphs.run = sticky
    with pytest.raises(RuntimeError, match="illegal memory access"):
        llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)
    assert not compiled.fallbacks and compiled.graphs is not None


def test_health_says_what_runs_after_a_fallback(flex_traced_as_on_a_gpu, tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(
        cuda_graphs, "wants_decode_graphs", lambda device, eager, backend: not eager and backend.captures_in_graphs
    )
    monkeypatch.setattr(DecodeGraphs, "capture_all", lambda graphs: 1 / 0)
    with serving(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64, attention_backend="auto")) as srv:
        status, body = srv.health()
    assert status == 200 and body["compiled_paths"] == {
        "attention": "flex", "cuda_graphs": "off", "fallbacks": ["CUDA graphs: capture failed: ZeroDivisionError: "
                                                                 "division by zero"],
    }


def test_sticky_cuda_error_fails_requests_answers_503_and_exits_non_zero(tiny_checkpoint, monkeypatch):
    """The worker stops; in-flight requests get a 503, /health says why, and `serve` returns 1."""
    from minfer.server import serve

    srv = serve.create_server(EngineConfig(str(tiny_checkpoint), num_kv_blocks=64), port=0)

    def sticky(chunks):
        raise RuntimeError(STICKY)

    srv.manager.scheduler.runner.execute = sticky
    monkeypatch.setattr(serve, "create_server", lambda *args, **kwargs: srv)
    port, replies = srv.server_address[1], []
    client = threading.Thread(target=lambda: replies.append(post(port, "/generate", {"prompt": "Hi"})))
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        client.start()
        assert serve.main(["--model", str(tiny_checkpoint), "--port", "0"]) == 1
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    client.join(10)
    assert replies == [503]
    status, body = srv.health()
    assert status == 503 and body["reason"].startswith("a sticky CUDA error: CUDA error: an illegal memory access")
