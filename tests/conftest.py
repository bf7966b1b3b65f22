"""Shared fixtures: random GPT-2 checkpoints written once per test session (the Hub is offline)."""

import gc
import json
import os
import tempfile

# Tests run the eager attention backend unless they ask for the compiled one (test_compiled_attention.py):
# compiling costs each new process (a served model, a tutorial) a few seconds. Set before minfer is imported.
os.environ.setdefault("MINFER_ATTENTION_BACKEND", "eager")
# And fp32, a GPU's too (whose default is bf16): the references (transformers) are fp32.
os.environ.setdefault("MINFER_DTYPE", "float32")
# And a fixed thread count: CpuShare (minfer/cpu/thread_share.py) would follow the machine's load (CI runs
# the tutorials beside the suite), and fp32 results change in their last bits with the thread count.
# tests/rooms/cpu/test_cpu_share.py tests the adaptation itself. One thread: the test models are small, so a
# second thread saves no time (measured: the same wall time, 30% more CPU time), and CI's cores are
# busy with the tutorials too, where a waiting OpenMP thread spins on a core another process needs.
os.environ.setdefault("MINFER_NUM_THREADS", "1")
# And a compile cache of the tests' own (minfer/compiled/saved_graphs.py), never the user's: kept between
# sessions, as Inductor's own cache under /tmp is, so that a session loads the graphs the last one compiled
# (an entry is compiled afresh where the code it traced changed). The cache's own tests use other directories.
os.environ["MINFER_CACHE"] = os.path.join(tempfile.gettempdir(), f"minfer-test-cache-{os.getuid()}")

# The device the engine, model and sampling tests run on: MINFER_DEVICE=cuda runs them on a GPU
# (EngineConfig reads it too, so every LLM() there follows). scripts/gpu_check.sh names the tests meant
# for it; the server, browser and lm-eval tests need packages a GPU machine may lack.
TEST_DEVICE = os.environ.get("MINFER_DEVICE", "cpu")

import pytest  # noqa: E402
import torch  # noqa: E402

from minfer.checkpoints import write_random_checkpoint  # noqa: E402

torch.set_num_threads(int(os.environ["MINFER_NUM_THREADS"]))


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(preset="tiny", layout="hub", seed=0, **overrides) -> Path, cached per arguments."""
    cache = {}

    def make(preset="tiny", layout="hub", seed=0, **overrides):
        key = (preset, layout, seed, json.dumps(overrides, sort_keys=True))  # overrides may hold dicts
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{preset}-{layout}")
            cache[key] = write_random_checkpoint(out, preset, layout, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint):
    """The default test model: 2 layers, 4 heads, 64 channels, vocab 512, context 512."""
    return make_checkpoint()


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where tests that build a model themselves put it: $MINFER_DEVICE, else the CPU."""
    return torch.device(TEST_DEVICE)


def only_on_cpu(reason: str):
    """Marks a test about the CPU's own paths (weight packing, threads): skipped on another device."""
    return pytest.mark.skipif(torch.device(TEST_DEVICE).type != "cpu", reason=f"a CPU path: {reason}")


@pytest.fixture(autouse=True)
def tiled_attention_on_narrow_caches(monkeypatch):
    """The test checkpoints' caches are narrower than any real model's (tiny: 4 heads x 16), where a CPU
    would run the plain backend (assembly/selector.py): the engine tests run the CPU's tiled backend on
    them, as real models do. tests/assembly/test_attention_backends.py runs the plain one through the engine."""
    from minfer.assembly import selector

    monkeypatch.setattr(selector, "MIN_CPU_KV_WIDTH", 0)


@pytest.fixture(autouse=True)
def packed_linears_on_small_weights(monkeypatch):
    """The test checkpoints' weights are smaller than any real model's, which a CPU would leave plain
    (cpu/linears.py, PACK_MIN_WEIGHTS): the engine tests pack them, as real models' are. The README's and
    tutorials' commands, the soak tests and the core-path script run minfer-tiny's plain ones."""
    from minfer.cpu import linears

    monkeypatch.setattr(linears, "PACK_MIN_WEIGHTS", 0)


@pytest.fixture(autouse=True)
def thread_count_restored():
    """A test that changes torch's thread count does not hand it to the next test in its worker (a seeded
    draw or a timing there would change with it)."""
    threads = torch.get_num_threads()
    yield
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


@pytest.fixture
def flex_as_on_a_gpu(monkeypatch):
    """Engines built in the test choose their attention as on a GPU: "auto" and "compiled" are FlexBackend
    (compiled/flex.py); "eager" stays the CPU's eager backend. flex_attention runs unfused: on a CPU each new shape would compile
    C++ anew, tens of seconds the suite can't spare. Unfused, every key of the cache is scored and the
    mask_mod decides alone; the fused kernels run on a GPU (scripts/gpu_check.sh)."""
    from torch.nn.attention.flex_attention import flex_attention

    from minfer.assembly import selector
    from minfer.compiled import flex_kernel

    monkeypatch.setitem(flex_kernel._compiled, ("static", "inductor"), flex_attention)
    choose = selector.backend_name

    def as_on_a_gpu(device, dtype, choice="auto", kv_width=None):
        return "flex" if choice in ("auto", "compiled") else choose(device, dtype, choice, kv_width)

    monkeypatch.setattr(selector, "backend_name", as_on_a_gpu)



FLEX_COMPILES = []  # every compile of flex as it serves, in this test session: the graph's inputs each


def count_and_trace(graph, inputs):
    """A torch.compile backend: counts the compile, then runs the traced graph as it is (Dynamo's "eager")."""
    FLEX_COMPILES.append(inputs)
    return graph.forward


@pytest.fixture
def flex_traced_as_on_a_gpu(flex_as_on_a_gpu, monkeypatch):
    """flex as it serves on a GPU (compiled/flex_kernel.py), on the CPU: compiled with dynamic shapes, each
    kind of step at start-up (compiled/warm_up.py), then sealed, so that a recompile raises. Through a backend
    that traces and counts (count_and_trace): the GPU's guards and recompiles, no kernels (about half a second
    a compile; what one test compiled, the next reuses). Yields FLEX_COMPILES."""
    from minfer.compiled import flex_kernel

    monkeypatch.setattr(flex_kernel, "SERVING_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(flex_kernel, "SERVING_BACKEND", count_and_trace)
    return FLEX_COMPILES


# The files that start first where xdist runs the suite (.ci/run: `-n 2 --dist loadfile
# --no-loadscope-reorder`), slowest first (each over 15 s on a quiet 2-core machine), so that the run never
# ends with one worker on one of them while the other sits idle (xdist's own order, most tests first, ran
# them last); elsewhere the order is pytest's own.
FIRST_FILES = [
    "tests/rooms/gpu/test_gpu_check.py",
    "tests/rooms/compiled/test_compiled_step.py",
    "tests/clients/test_stress.py",
    "tests/rooms/speculative/test_speculative_draft.py",
    "tests/architecture/test_entry_points.py",
    "tests/rooms/compiled/test_compiled_attention.py",
    "tests/server/test_live_view_browser.py",
    "tests/server/test_startup.py",
    "tests/clients/test_lm_eval.py",
]


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    rank = {path: i for i, path in enumerate(FIRST_FILES)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: the rest keep their order


def pytest_collection_finish(session):
    """What the imports and the collection made (torch, transformers, every test module: most of the
    process's objects) lives to the end: frozen, Python's full collections no longer walk it (they were a
    tenth of a worker's CPU time, 6 of 55 s in tests/server and tests/core)."""
    gc.collect()
    gc.freeze()
