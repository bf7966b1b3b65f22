"""What a compile cache entry's graphs depend on, so that none is ever loaded where it would not be exact.

Two checks, one before and one after reading an entry:
- The key (artifacts.py hashes it into the entry's name) holds what names the graphs: the caller's parts
  (shapes, dtype, the model's structure, the settings that shape the graph) and `common_parts`: minfer's
  version and a hash of the compiled room (how minfer compiles: guards, options, settings), torch's
  version and build, Python's, and the machine: the CPU's feature flags (Inductor's C++ is built for
  them) or the GPU's name and compute capability. A part that changes names another entry.
- The code the graphs traced: each graph records the functions Dynamo traced and their modules
  (torch's `source_info`); an entry keeps a hash of each module's file (`traced_sources`), and an entry
  whose modules changed since is compiled afresh (`changed_sources`). Only an edit to the code a graph
  traced recompiles it, not one anywhere in minfer. torch.export (the whole forward's packages) keeps no
  such record: the Python files whose functions ran while it traced are recorded as it runs
  (`files_called`: minfer's own, named from its folder), each with a hash (`file_hashes`), and checked alike
  against the minfer that loads the entry (`changed_files`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import itertools
import platform
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from pathlib import Path

import torch

from ..cpu.features import cpu_flags
from ..version import __version__

ROOM = Path(__file__).resolve().parent  # minfer/compiled
MINFER = ROOM.parent


def common_parts(device: torch.device | str = "cpu") -> dict:
    """The key's parts every entry shares: how it was compiled, and what it ran on."""
    device = torch.device(device)
    parts = {
        "minfer": __version__,
        "minfer_compiled": room_hash(),
        "torch": torch.__version__,
        "torch_git": torch.version.git_version,
        "python": sys.version.split()[0],
        "machine": platform.machine(),
        "device": device.type,
    }
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        parts["gpu"] = f"{torch.cuda.get_device_name(index)}, sm {torch.cuda.get_device_capability(index)}"
    else:
        parts["cpu_flags"] = " ".join(sorted(cpu_flags()))
    return parts


def model_fingerprint(model: torch.nn.Module) -> str:
    """What a graph of `model`'s blocks depends on beyond the code: the checkpoint's config, and the modules as
    built from it (each one's class and plain settings: a quantized or packed linear shows as one; every
    parameter's and buffer's name, shape, dtype and layout). Not the weights' values: the block graph takes
    them as inputs."""
    digest = hashlib.sha256(repr(getattr(model, "config", None)).encode())
    for name, module in model.named_modules():
        plain = sorted((k, v) for k, v in vars(module).items() if isinstance(v, (bool, int, float, str)))
        digest.update(f"{name} {type(module).__qualname__} {plain}\n".encode())
    for name, tensor in itertools.chain(model.named_parameters(), model.named_buffers()):
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype} {tensor.layout}\n".encode())
    return digest.hexdigest()[:16]


@lru_cache(maxsize=None)
def room_hash() -> str:
    """A hash of the compiled room's files: how minfer compiles (guard filters, Inductor's options, the
    settings a step compiles under) shapes every graph without being traced into it."""
    digest = hashlib.sha256()
    for path in sorted(ROOM.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def traced_sources(graphs: list) -> dict[str, str]:
    """The modules whose code `graphs` traced, each with a hash of its file; torch's own are covered by its
    version in the key, and a module without a file (a `python -c` script) cannot be checked."""
    names = {source.module for graph in graphs for source in graph.source_info().inlined_sources}
    files = {name: _file_of(name) for name in names if name.split(".")[0] != "torch"}
    return {name: _file_hash(file) for name, file in sorted(files.items()) if file is not None}


def changed_sources(saved: dict[str, str]) -> list[str]:
    """The modules of `traced_sources` whose files are not as they were."""
    return [name for name, digest in saved.items() if _file_hash(_file_of(name)) != digest]


def _file_of(module_name: str) -> str | None:
    module = sys.modules.get(module_name)
    if module is not None:
        return getattr(module, "__file__", None)
    try:
        spec = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def _file_hash(file: str | None) -> str | None:
    try:
        return hashlib.sha256(Path(file).read_bytes()).hexdigest()[:16] if file else None
    except OSError:
        return None


@contextmanager
def files_called() -> Iterator[set[str]]:
    """minfer's files whose functions the body calls, on this thread: the code a trace by torch.export runs
    (the versions of torch and Python, the rest of it, are in the key). Its stack traces leave out a helper
    another file defines; a profile hook misses no call, and costs the export of GPT-2 a fifth of its 0.4 s."""
    found: set[str] = set()

    def note(frame, event, arg):
        if event == "call":
            found.add(frame.f_code.co_filename)

    previous = sys.getprofile()
    sys.setprofile(note)
    try:
        yield found
    finally:
        sys.setprofile(previous)
        # named from minfer's folder (minfer/models/gpt2.py): checked against the minfer that loads the entry,
        # not a checkout elsewhere that built it and may hold other code
        ours = {str(path.relative_to(MINFER.parent)) for path in map(Path.resolve, map(Path, found))
                if path.is_relative_to(MINFER)}
        found.clear()
        found.update(ours)


def file_hashes(files) -> dict[str, str | None]:
    return {file: _file_hash(str(MINFER.parent / file)) for file in sorted(files)}  # an absolute path stays


def changed_files(saved: dict[str, str | None]) -> list[str]:
    """The files of `file_hashes` that are not as they were (or are gone)."""
    return [file for file, digest in saved.items() if _file_hash(str(MINFER.parent / file)) != digest]
