"""Compile once, load after (minfer/compiled/saved_graphs.py): a start saves the graphs it compiled in
minfer's compile cache, the next start with the same key loads them instead of compiling, and nothing the
cache does can stop a start or serve a wrong graph. Most tests compile one small function; the last starts
an engine twice with compiled attention and the compiled decode step forced on."""

import errno
import fcntl
import logging
import os
import pickle
import platform
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from engine_checks import GREEDY

from minfer import LLM
from minfer.compiled import artifacts, cache_sweep, packaged
from minfer.compiled.precompiled import PrecompiledFunction
from minfer.compiled.saved_graphs import trust_vector_isas, warm_up_saved
from minfer.server.banner import banner_lines

def scaled_sum(x, y):
    return (x * 2 + y).sum(0)


ARGS = (torch.arange(12.0).view(3, 4), torch.ones(4))
WANT = scaled_sum(*ARGS)  # the plain function's


def start(name="toy", parts=None, before=lambda: None, function=None):
    """One start's warm-up of a fresh PrecompiledFunction(scaled_sum), `before` it runs the function: (its
    record, the function, its result)."""
    function = function or PrecompiledFunction(scaled_sum, "scaled_sum")
    out = {}

    @torch.inference_mode()
    def warm_up():
        before()
        out["sum"] = function(*ARGS)
        return None

    why_not, record = warm_up_saved(name, [function], parts or {"test": name}, warm_up)
    assert why_not is None
    return record, function, out["sum"]


@pytest.fixture(scope="module")
def cache_root():
    """One cache for the small function's tests (each under keys of its own), its entries emptied: beside
    the session's (tests/conftest.py), so that Inductor's own cache in it keeps the C++ kernel from one
    session to the next, and a test's compile only traces and generates code."""
    root = Path(os.environ["MINFER_CACHE"] + "-of-its-tests")
    shutil.rmtree(root / "entries", ignore_errors=True)
    return root


@pytest.fixture
def cache(cache_root, monkeypatch):
    monkeypatch.setenv("MINFER_CACHE", str(cache_root))
    return cache_root


def entries(root: Path, name: str) -> list[Path]:
    return sorted((root / "entries").glob(f"{name}-*.bin"))


def mode(path: Path) -> str:
    return oct(path.stat().st_mode & 0o777)


def test_a_cold_start_saves_and_a_warm_start_loads(cache):
    cold, function, got = start("cold-warm")
    assert cold.how == "compiled" and (cold.num_loaded, cold.num_compiled) == (0, 1)
    assert str(cold).startswith("compiled (cold, ")
    assert torch.equal(got, WANT) and [cold.path] == entries(cache, "cold-warm")
    assert mode(cache) == mode(cache / "inductor") == "0o700" and mode(cold.path) == "0o600"
    warm, function, got = start("cold-warm")
    assert warm.how == "loaded" and (warm.num_loaded, warm.num_compiled) == (1, 0)
    assert str(warm).startswith("loaded (warm, ")
    assert torch.equal(got, WANT)


def test_a_warm_start_takes_the_vector_isas_its_entry_found(cache):
    """Inductor probes each vector instruction set once a process, a compile and a load each (1.5-2 s of a warm
    start). An entry records those its start found; a later start whose CPU's flags claim the same takes them
    without the probe, and one whose claim differs (a compiler that refused one) probes as Inductor does."""
    from torch._inductor import config, cpu_vec_isa

    cold, _, _ = start("isas")
    found = pickle.loads(cold.path.read_bytes())["vector_isas"]
    assert found and found == [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()]
    x86 = platform.machine() in ("x86_64", "AMD64")
    for recorded, taken in [(found, True if x86 else None), (found[1:], None), (None, None)]:
        with config.patch({"cpp.vec_isa_ok": None}):  # torch's own undo: a monkeypatch may delete the setting
            trust_vector_isas(recorded)
            assert config.cpp.vec_isa_ok is taken
    assert start("isas")[0].how == "loaded"


def test_a_stale_key_names_another_entry(cache):
    start("stale", {"dtype": "float32"})
    other, _, got = start("stale", {"dtype": "bfloat16"})  # a part changed: compiled, never loaded
    assert other.how == "compiled" and other.num_loaded == 0 and torch.equal(got, WANT)
    assert len(entries(cache, "stale")) == 2


def test_a_corrupt_entry_is_compiled_afresh_and_replaced(cache, caplog):
    first, _, _ = start("corrupt")
    first.path.write_bytes(first.path.read_bytes()[:100])  # cut short
    with caplog.at_level(logging.WARNING, logger="minfer"):
        again, _, got = start("corrupt")
    assert again.how == "compiled" and torch.equal(got, WANT)
    assert "unreadable, compiling afresh" in caplog.text
    assert start("corrupt")[0].how == "loaded"  # replaced by a whole one
    # A whole file of graphs torch cannot read (another build's, say): compiled afresh too.
    first.path.write_bytes(pickle.dumps({"graphs": {"scaled_sum": pickle.dumps([b"not a graph"])}, "sources": {}}))
    assert start("corrupt")[0].how == "compiled"


def test_an_edit_to_the_code_a_graph_traced_compiles_it_afresh(cache, caplog):
    first, _, _ = start("edited")
    saved = pickle.loads(first.path.read_bytes())
    assert list(saved["sources"]) == [__name__]  # scaled_sum's module: this file
    saved["sources"][__name__] = "another version of this file"
    first.path.write_bytes(pickle.dumps(saved))
    with caplog.at_level(logging.INFO, logger="minfer"):
        assert start("edited")[0].how == "compiled"
    assert f"traced changed ({__name__})" in caplog.text
    assert start("edited")[0].how == "loaded"  # saved again, with this file's hash


def test_a_full_disk_compiles_in_memory(cache, monkeypatch, caplog):
    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(artifacts, "write_atomically", full)
    with caplog.at_level(logging.WARNING, logger="minfer"):
        record, function, got = start("full")
    assert torch.equal(got, WANT) and record.how == "compiled" and "No space left on device" in record.not_saved
    assert "not saved" in caplog.text and not entries(cache, "full")
    assert torch.equal(function(*ARGS), WANT)  # and serves


def test_a_graph_torch_cannot_precompile_is_compiled_in_memory(cache, caplog):
    """Where the precompile fails (an older torch, a graph it cannot save), torch.compile serves, unsaved."""
    function = PrecompiledFunction(scaled_sum, "scaled_sum")
    function._compiler = types.SimpleNamespace(aot_compile=lambda inputs: 1 / 0)
    with caplog.at_level(logging.WARNING, logger="minfer"):
        record, _, got = start("unsaveable", function=function)
    assert torch.equal(got, WANT) and record.how == "compiled" and "ZeroDivisionError" in record.not_saved
    assert "compiling it in memory" in caplog.text and not entries(cache, "unsaveable")


# The second of two starts at once, in a process of its own: it waits on the entry's lock, then loads.
SECOND_START = """
import logging, sys
from pathlib import Path
import torch
from minfer.compiled.precompiled import PrecompiledFunction
from minfer.compiled.saved_graphs import warm_up_saved

def scaled_sum(x, y):
    return (x * 2 + y).sum(0)

class Waiting(logging.Handler):
    def emit(self, record):
        if "another start is compiling" in record.getMessage():
            Path(sys.argv[1]).touch()

logging.getLogger("minfer").addHandler(Waiting())
logging.getLogger("minfer").setLevel(logging.INFO)
function, args = PrecompiledFunction(scaled_sum, "scaled_sum"), (torch.arange(12.0).view(3, 4), torch.ones(4))

@torch.inference_mode()
def warm_up():
    assert torch.equal(function(*args), scaled_sum(*args))

print(warm_up_saved("two-processes", [function], {"test": "two-processes"}, warm_up)[1].how)
"""


def test_two_starts_at_once_compile_once(cache, tmp_path):
    """Two processes, one key: this one takes the entry's lock and compiles only once the other is waiting
    for it; the other then loads what this one wrote."""
    waiting = tmp_path / "waiting"
    # This file on its path: the entry records the module the graph traced, this one, and checks it is unchanged.
    path = filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    second = subprocess.Popen([sys.executable, "-c", SECOND_START, str(waiting)], text=True, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)

    def until_the_second_waits():  # minutes, not seconds: a busy 2-core machine starts torch slowly
        deadline = time.monotonic() + 240
        while not waiting.exists():
            assert second.poll() is None and time.monotonic() < deadline, second.communicate()
            time.sleep(0.05)

    first, _, got = start("two-processes", {"test": "two-processes"}, before=until_the_second_waits)
    said = second.communicate(timeout=240)
    assert second.returncode == 0 and said[0].split() == ["loaded"], said
    assert first.how == "compiled" and torch.equal(got, WANT) and len(entries(cache, "two-processes")) == 1


def test_kernels_inductor_cached_are_told_apart_from_a_compile(cache):
    """A warm-up that torch.compiles for itself (the whole forward, step.py) with Inductor's cache in minfer's:
    the second start traces again and loads every kernel, and its record says so."""

    def warm_up():  # a fresh code object each time: Dynamo compiles it anew, as a new process would
        again = types.FunctionType(scaled_sum.__code__.replace(co_name="scaled_sum_again"), globals())
        assert torch.equal(torch.compile(again)(*ARGS), WANT)

    hows = [warm_up_saved("traced", [], {}, warm_up)[1].how for _ in range(2)]
    assert hows[0] in ("compiled", "traced") and hows[1] == "traced"  # traced: a session before compiled it


@pytest.mark.parametrize("builds_a_kernel", [False, True])
def test_a_graph_lowered_again_says_whether_it_built_a_kernel(cache, builds_a_kernel):
    """Frozen weights (--compile-model's whole forward) keep a graph out of Inductor's graph cache (a bypass):
    a later start lowers it again, onto kernels from the cache, and its record says traced; one that had to
    build a kernel says compiled. (Seen on minfer-tiny: 71.8 s compiled, then 17.7 s traced.)"""
    from torch._dynamo.utils import counters

    kernel = cache / "inductor" / "test-kernels" / f"built-{os.getpid()}.so"

    def warm_up():  # what such a start leaves behind, without the minute it takes
        counters["inductor"]["fxgraph_cache_bypass"] += 1
        if builds_a_kernel:
            kernel.parent.mkdir(parents=True, exist_ok=True)
            kernel.touch()

    try:
        assert warm_up_saved("bypass", [], {}, warm_up)[1].how == ("compiled" if builds_a_kernel else "traced")
    finally:
        kernel.unlink(missing_ok=True)


def unused(tmp_path, monkeypatch, root) -> tuple:
    """A warm-up that compiles nothing, under MINFER_CACHE=root: (its record's why-not-saved, whether
    anything was written)."""
    monkeypatch.setenv("MINFER_CACHE", str(root))
    _, record = warm_up_saved("unused", [], {}, lambda: None)
    return record.not_saved, any(tmp_path.rglob("*.bin"))


def test_a_directory_others_can_write_is_refused(tmp_path, monkeypatch):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    why, wrote = unused(tmp_path, monkeypatch, shared)
    assert "writable by other users" in why and not wrote


def test_a_directory_inside_one_others_can_write_is_refused(tmp_path, monkeypatch):
    """Others who can write a folder above the cache can rename the cache away and put theirs in its place: refused,
    unless that folder is sticky (as /tmp is), where only its owner may rename what is in it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    why, wrote = unused(tmp_path, monkeypatch, shared / "mine")
    assert f"lies in {shared}, which other users can write" in why and not wrote
    shared.chmod(0o1777)
    assert unused(tmp_path, monkeypatch, shared / "mine")[0] is None


def scaled_difference(x, y):
    return (x * 3 - y).amax(0)


def test_inductors_own_directory_others_can_write_is_not_compiled_into(tmp_path, monkeypatch, caplog):
    """Every compile outside a warm-up (a recompile mid-serve, every one with the cache off or refused) writes and
    loads its kernels in Inductor's own directory, /tmp/torchinductor_<user> unless told: where another user
    made it first (here: writable by others), this process compiles into a new directory of its own."""
    theirs = tmp_path / "torchinductor_theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(theirs))
    monkeypatch.setenv("MINFER_CACHE", "off")
    function = PrecompiledFunction(scaled_difference, "scaled_difference")  # a graph no other test compiles
    with caplog.at_level(logging.WARNING, logger="minfer"):
        record, _, got = start("off-theirs", function=function)
    assert record.how == "compiled" and torch.equal(got, scaled_difference(*ARGS))
    ours = Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    assert ours != theirs and mode(ours) == "0o700" and ours.stat().st_uid == os.getuid()
    assert "writable by other users" in caplog.text and not list(theirs.iterdir())
    assert list(ours.rglob("*.so")) or list(ours.rglob("*.py"))  # the compile's kernels went there
    shutil.rmtree(ours)


def test_a_private_inductor_directory_is_removed_at_exit(tmp_path):
    """The directory a process compiles into, Inductor's own being unsafe, is that process's alone: it goes at exit."""
    theirs = tmp_path / "torchinductor_theirs"
    theirs.mkdir()
    theirs.chmod(0o777)
    code = ("import os; from minfer.compiled.artifacts import check_inductors_own; check_inductors_own(); "
            "d = os.environ['TORCHINDUCTOR_CACHE_DIR']; open(os.path.join(d, 'kernel.so'), 'w').close(); print(d)")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(theirs)}
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    private = Path(run.stdout.strip())
    assert private != theirs and private.name.startswith("minfer-inductor-") and not private.exists()


def test_a_directory_of_another_user_is_refused(tmp_path, monkeypatch):
    if os.getuid() != 0:
        pytest.skip("giving a directory to another user takes root")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, -1)
    why, wrote = unused(tmp_path, monkeypatch, theirs)
    assert "belongs to another user" in why and not wrote
    theirs.chmod(0o755)
    why, wrote = unused(tmp_path, monkeypatch, theirs / "mine")  # a folder of ours in theirs: they can swap it
    assert f"lies in {theirs}, which belongs to another user" in why and not wrote


def test_an_unwritable_directory_compiles_in_memory(tmp_path, monkeypatch):
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    why, wrote = unused(tmp_path, monkeypatch, blocked / "minfer")  # cannot be made
    assert "cannot be used" in why and not wrote
    monkeypatch.setenv("MINFER_CACHE", "off")
    record, _, got = start("off")
    assert record.how == "compiled" and "MINFER_CACHE=off" in record.not_saved and torch.equal(got, WANT)


def test_the_default_directory_follows_xdg(monkeypatch, tmp_path):
    monkeypatch.delenv("MINFER_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert artifacts.cache_root() == tmp_path / "minfer"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert artifacts.cache_root() == Path.home() / ".cache" / "minfer"


DAY = 86400.0


def an_entry(entries: Path, stem: str, days_unused: float) -> None:
    """An entry as a package set leaves it: its record, lock and package folder, all last touched then."""
    for suffix in (".bin", ".json", ".lock"):
        (entries / f"{stem}{suffix}").write_bytes(b"x")
    (entries / f"{stem}.lone").mkdir()
    (entries / f"{stem}.lone" / "model.so").write_bytes(b"x")
    then = time.time() - days_unused * DAY
    for path in entries.glob(f"{stem}.*"):
        os.utime(path, (then, then))


def test_entries_unused_for_30_days_are_removed_and_no_other(tmp_path):
    """An entry whose lock no start has taken for 30 days goes, its package folder and the temporary files of a
    killed start included; one used within 30 days stays, and so does an old one whose lock a start holds."""
    entries = tmp_path / "entries"
    entries.mkdir()
    old, recent, held = (f"whole-forward-package-{c * 32}" for c in "abc")
    an_entry(entries, old, days_unused=31)
    an_entry(entries, recent, days_unused=29)
    an_entry(entries, held, days_unused=40)
    (entries / f".{old}.bin.k2j3").write_bytes(b"x")  # a killed start's temporary file, and its build folder
    (entries / f"{old}.batch.4242.part").mkdir()
    (entries / "notes.txt").write_text("not an entry")
    fd = os.open(entries / f"{held}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # another start is loading it
        assert cache_sweep.sweep(entries) == [old]
    finally:
        os.close(fd)
    kept = sorted(p.name for p in entries.iterdir())
    assert kept == sorted([f"{stem}{s}" for stem in (recent, held) for s in (".bin", ".json", ".lock", ".lone")]
                          + ["notes.txt"])
    assert (entries / f"{recent}.lone" / "model.so").exists()


def test_a_start_marks_its_entry_used_and_sweeps_the_cache_once(tmp_path, monkeypatch, caplog):
    """Opening the cache removes the entries unused for 30 days (once a process); taking an entry's lock marks
    it used, so an entry in use never ages out."""
    root = tmp_path / "cache"
    (root / "entries").mkdir(parents=True, mode=0o700)
    an_entry(root / "entries", "attention-" + "d" * 32, days_unused=45)
    monkeypatch.setenv("MINFER_CACHE", str(root))
    with caplog.at_level(logging.INFO, logger="minfer"):
        assert artifacts.open_cache() == (root, None)
    assert list((root / "entries").iterdir()) == []
    assert "removed 1 compile cache entry unused for 30 days" in caplog.text
    entry = artifacts.CacheEntry(root, "toy", {"test": "marked"})
    an_entry(root / "entries", entry.path.stem, days_unused=45)
    with entry.locked() as unlocked:
        assert unlocked is None
    assert time.time() - entry.lock_path.stat().st_mtime < DAY
    assert cache_sweep.sweep(root / "entries") == []  # marked used just now
    an_entry(root / "entries", "attention-" + "e" * 32, days_unused=45)
    artifacts.open_cache()  # a second open in the same process does not sweep again: the next start's does
    assert (root / "entries" / f"attention-{'e' * 32}.bin").exists()


def test_a_second_engine_start_loads_its_compiled_graphs(tiny_checkpoint):
    """A tiny GPT-2 with compiled attention and the compiled decode step forced on, in the session's cache
    (tests/conftest.py), which an earlier test of the same shapes may have filled: the first start compiles
    or loads, the second loads every graph (its banner and /health say so), and its greedy tokens are
    eager's."""
    settings = dict(num_kv_blocks=64, attention_backend="compiled", compile_decode_step=True)
    LLM(tiny_checkpoint, **settings)
    llm = LLM(tiny_checkpoint, **settings)
    cache = llm.stats()["compiled_paths"]["compile_cache"]
    assert cache["attention"].startswith("loaded (warm, ") and cache["decode_step"].startswith("loaded (warm, "), cache
    banner = "\n".join(banner_lines(llm.scheduler, "float32", "-", False))
    assert "attention: compiled; graphs loaded (warm, " in banner
    assert "decode steps compiled, graphs loaded (warm, " in banner
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 400, (int(n),), generator=g).tolist() for n in (3, 20, 41)]
    eager = LLM(tiny_checkpoint, num_kv_blocks=64, attention_backend="eager")
    want = [o.token_ids for o in eager.generate(prompts, GREEDY, use_tqdm=False)]
    assert [o.token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want


def test_a_lock_that_cannot_be_opened_is_the_reason_given_and_the_forward_compiles_in_memory(tmp_path, monkeypatch):
    """An entry whose lock file cannot be opened (here a folder stands at its path; elsewhere a permission or
    disk error) is not built into the cache: the reason given is the OSError's, not another start's lock."""
    root = tmp_path / "cache"
    (root / "entries").mkdir(parents=True, mode=0o700)
    monkeypatch.setenv("MINFER_CACHE", str(root))

    def entry_with_a_folder_for_its_lock(*args):
        entry = artifacts.CacheEntry(*args)
        entry.lock_path.mkdir()
        return entry

    monkeypatch.setattr(packaged, "CacheEntry", entry_with_a_folder_for_its_lock)
    forward, record, why_not = packaged.load_or_build(torch.nn.Linear(2, 2), None, None, {"test": "lock"}, {})
    assert forward is None and record is None  # the caller compiles the forward in memory instead
    assert "lock" in why_not and os.strerror(errno.EISDIR) in why_not and "another start" not in why_not, why_not
