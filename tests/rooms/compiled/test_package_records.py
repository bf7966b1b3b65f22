"""The whole forward's AOTInductor packages on disk (minfer/compiled/packaged.py): each file's size recorded as
written, the files of minfer's code their export ran and a hash of each, judged in the checkout that loads
them, and the batch package's own weights dropped only where the lone package's serve for every one. Folders
written by hand: nothing here compiles."""

import errno
import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch

from minfer.compiled.cache_key import _file_hash, changed_files, file_hashes, files_called
from minfer.compiled.packaged import (
    BUILD_ID, SIZES, TRACED, _drop_own_weights, _usable, check_sizes, package_id, record_sizes,
)
from minfer.compiled.shared_constants import SHARED, own_weights


def test_a_package_cut_short_is_refused_before_it_is_loaded(tmp_path):
    """A whole-forward package's library cut short kills the process that maps it (SIGBUS): each file's size is
    recorded as the package is written, and a package whose files differ is refused with a ValueError, which
    has it built again (packaged.py's load_or_build)."""
    folder = tmp_path / "package"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "model.so").write_bytes(b"x" * 4096)
    (folder / "version").write_text("1")
    record_sizes(folder)
    check_sizes(folder)  # as written
    with open(folder / "data" / "model.so", "r+b") as library:
        library.truncate(1000)
    with pytest.raises(ValueError, match="model.so is 1000 bytes, written at 4096"):
        check_sizes(folder)
    (folder / "data" / "model.so").unlink()
    with pytest.raises(ValueError, match="model.so is missing"):
        check_sizes(folder)
    (folder / SIZES).unlink()
    with pytest.raises(ValueError, match=f"{SIZES} is missing"):
        check_sizes(folder)


def test_a_batch_package_that_dropped_its_weights_is_built_again_with_a_new_lone_package(tmp_path):
    """Once the record names the lone package's weights for every one of the batch package's, the batch package's
    own copy leaves the disk, and its size record no longer names it; the record is good for that lone build
    only: built again, the lone package makes the batch package unusable (so it is built again too)."""
    paths = {"lone": tmp_path / "entry.lone", "batch": tmp_path / "entry.batch"}
    for folder in paths.values():
        (folder / "data" / "aotinductor" / "model").mkdir(parents=True)
        (folder / "data" / "aotinductor" / "model" / "w.so").write_bytes(b"library")
        (folder / "data" / "aotinductor" / "model" / "w.blob").write_bytes(b"weights")
        (folder / BUILD_ID).write_text("build 1")
        (folder / TRACED).write_text("{}")
        record_sizes(folder)
    batch = types.SimpleNamespace(package=paths["batch"], blob=own_weights(paths["batch"]))
    (paths["batch"] / SHARED).write_text(json.dumps({"owner": package_id(paths["lone"]), "constants": {}}))
    _drop_own_weights(batch)
    assert batch.blob is None and own_weights(paths["batch"]) is None
    check_sizes(paths["batch"])  # as good a package as before
    _usable("batch", paths["batch"], paths)
    (paths["lone"] / BUILD_ID).write_text("build 2")  # the same files, the same sizes: another build all the same
    record_sizes(paths["lone"])
    with pytest.raises(ValueError, match="built again since"):
        _usable("batch", paths["batch"], paths)
    _usable("lone", paths["lone"], paths)


def a_package(folder: Path, traced: dict) -> Path:
    """A package's folder as _build leaves it: a library, its weights, its build and the files its export ran."""
    (folder / "data" / "aotinductor" / "model").mkdir(parents=True)
    (folder / "data" / "aotinductor" / "model" / "w.blob").write_bytes(b"weights")
    (folder / BUILD_ID).write_text("build 1")
    (folder / TRACED).write_text(json.dumps(traced))
    record_sizes(folder)
    return folder


def test_a_package_whose_traced_code_changed_is_built_again(tmp_path):
    """A package holds the model's code as it was traced, and minfer's version names no commit: an edit to a file
    its export ran (the model's, say) makes it unusable, built again, as a saved graph is (saved_graphs.py). A
    package without the record (or with one cut short) is built again too."""
    model_file = tmp_path / "model.py"
    model_file.write_text("def forward(x):\n    return x\n")
    paths = {"lone": a_package(tmp_path / "entry.lone", file_hashes([str(model_file)]))}
    _usable("lone", paths["lone"], paths)
    model_file.write_text("def forward(x):\n    return 2 * x\n")  # a fix to the model: same version, same shapes
    with pytest.raises(ValueError, match=f"the code it traced changed since \\({model_file}\\)"):
        _usable("lone", paths["lone"], paths)
    model_file.unlink()
    with pytest.raises(ValueError, match="changed since"):
        _usable("lone", paths["lone"], paths)
    (paths["lone"] / TRACED).write_text("{")
    with pytest.raises(ValueError, match=f"{TRACED} is missing or unreadable"):
        _usable("lone", paths["lone"], paths)


def test_the_files_a_trace_ran_are_minfers_own_and_any_profiler_is_restored():
    """What a package records (packaged.py's _build): each of minfer's files a function of which ran, a helper in
    another file too (torch.export's stack traces leave those out); neither this file nor torch's."""
    from minfer.attention import kv_cache
    from minfer.attention.paged import paged_attention  # noqa: F401 (imported before: no import is recorded)

    def previous(frame, event, arg):
        pass

    sys.setprofile(previous)
    try:
        with files_called() as files:
            kv_cache.cdiv(5, 2)
            torch.ones(2).sum()
        assert sys.getprofile() is previous
    finally:
        sys.setprofile(None)
    assert "minfer/attention/kv_cache.py" in files  # named from minfer's folder, wherever the checkout lies
    assert all(f.startswith("minfer/") for f in files) and "torch" not in str(files), files
    assert file_hashes(files)["minfer/attention/kv_cache.py"] == _file_hash(kv_cache.__file__)


def test_a_package_is_judged_by_the_code_of_the_minfer_that_loads_it(tmp_path, monkeypatch):
    """The files a package's export ran are checked in the checkout that loads it: another checkout sharing the
    cache, whose model code differs, builds its own (the record once named the builder's files, which had not
    changed, and the other checkout served a graph of code it does not hold); the same code anywhere loads."""
    from minfer.compiled import cache_key

    record = file_hashes(["minfer/attention/kv_cache.py"])
    assert changed_files(record) == []
    other = tmp_path / "checkout"  # a copy of minfer elsewhere: the same code, then an edit to it
    shutil.copytree(cache_key.MINFER / "attention", other / "minfer" / "attention")
    monkeypatch.setattr(cache_key, "MINFER", other / "minfer")
    assert changed_files(record) == []
    with open(other / "minfer" / "attention" / "kv_cache.py", "a") as f:
        f.write("# an edit\n")
    assert changed_files(record) == ["minfer/attention/kv_cache.py"]


def test_a_full_disk_keeps_the_batch_packages_own_weights_and_the_packages_serve(tmp_path, monkeypatch):
    """Dropping the batch package's own weights writes a size record first: where the disk refuses, nothing
    changes (no half-written file left) and the start goes on with the packages it loaded."""
    folder = tmp_path / "entry.batch"
    (folder / "data" / "aotinductor" / "model").mkdir(parents=True)
    (folder / "data" / "aotinductor" / "model" / "w.blob").write_bytes(b"weights")
    record_sizes(folder)
    batch = types.SimpleNamespace(package=folder, blob=own_weights(folder))

    def full(*args):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "replace", full)
    _drop_own_weights(batch)  # does not raise
    assert batch.blob is not None and batch.blob.is_file()
    assert sorted(p.name for p in folder.iterdir()) == ["data", SIZES]  # no half-written size record left
    check_sizes(folder)
