"""--compile-model's whole forward as AOTInductor packages: compiled once, loaded by every later start in seconds.

torch.compile keeps what it compiles in the process, and the whole forward's graph, its weights frozen in and
packed by oneDNN for Inductor's GEMM templates, is one Inductor's graph cache cannot keep ("mkldnn tensors
unpickleable"): every start traced and compiled it again, a minute or more. torch.export and AOTInductor
(`aoti_compile_and_package`) compile the same graph, with the same settings, into a package on disk: the
kernels and the packed weights, loaded by later starts in seconds.

Two packages, as the torch.compile path has two graphs: a lone sequence's decode (one row, static), and
batches (two rows or more; CompiledDecodeStep pads a lone prompt's chunk to two sampled rows). In batches,
attention is the opaque op (paged_op.py), reading the step's metadata from `compiled_step`'s slot at run
time; a lone decode's is traced in where the backend offers it, its metadata's tensors inputs of the package.
The packages hold the weights' values, so their key holds a hash of them (`weights_fingerprint`) besides the
compiled step's own parts; they live beside the step's cache entry, written under its lock, each unpacked
into a temporary folder renamed into place. Unpacked, a package loads where it lies: an archive would be
unpacked into a temporary folder at every start (Qwen3-0.6B bf16: 14-23 s against 5-6 s). Each keeps its weights
in a file beside its library: the lone package copies its own into memory, and the batch package reads the lone
one's copy instead, and drops its own file once that is recorded (shared_constants.py, `_drop_own_weights`):
docs/performance.md has what they cost. A package Inductor fails to build is built once more without epilogue
fusion (`_built`). A package whose traced code (a file of minfer's its export ran) changed since is built
again (`_usable`). Anything that fails (an export a model's modules refuse, a full disk, a package that will not
load) returns why, and the step compiles in memory as before.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import shutil
import time
import types
import uuid
import zipfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import torch

from ..attention.paged import PagedBatch
from ..cpu.huge_pages import in_huge_pages_soon
from ..cpu.malloc import freed_memory_returned
from .artifacts import CacheEntry, open_cache, write_atomically
from .attention import failure_line, lone_decode_tensors, with_lone_decode_tensors
from .cache_key import MINFER, changed_files, common_parts, file_hashes, files_called
from .inductor_templates import templates_compiled_once
from .paged_op import OpaqueAttention, compiled_step
from .saved_graphs import CompileRecord, inductor_cache_in
from .shared_constants import (
    SHARED, PackageRunner, attach_constants, own_weights, recorded_owner, unique_constant_sources,
)

log = logging.getLogger("minfer")


class _OnTensors(torch.nn.Module):
    """The model's step forward with tensors for arguments, as torch.export takes them: the paged batch is made
    around them, its metadata a stand-in whose backend is the opaque op."""

    def __init__(self, model: torch.nn.Module, meta):
        super().__init__()
        self.model, self.meta = model, meta

    def forward(self, input_ids, positions, kv, sample_rows):  # (N,), (N,), the whole cache, (S,) -> (S, V)
        return self.model(input_ids, PagedBatch(positions, types.SimpleNamespace(kv=kv), self.meta, sample_rows))


class _LoneOnTensors(_OnTensors):
    """A lone sequence's decode, its attention traced in (`traced_lone_decode`): the metadata that attention
    reads is an input too, or the package would keep the example step's (lone_decode_tensors). Each layer's
    cache is an input of its own: as views of one input, every layer's K/V write but the first was lost
    (torch 2.13's AOTInductor, views at symbolic offsets)."""

    def forward(self, input_ids, positions, layers, sample_rows, slot_mapping, tables, lens):
        # (1,), (1,), a (num_blocks, 2, Hkv, D * B) per layer, (1,), (1,), (1, NB), (1,) -> (1, V)
        meta = with_lone_decode_tensors(self.meta, slot_mapping, tables, lens)
        return self.model(input_ids, PagedBatch(positions, types.SimpleNamespace(kv=layers), meta, sample_rows))


class PackagedForward:
    """Called as the compiled step calls its graph: (input_ids (N,), the step's batch) -> logits (S, V)."""

    def __init__(self, lone, batch, lone_traced: bool):
        self.lone, self.batch = lone, batch
        self.lone_traced = lone_traced  # the lone package has its attention traced in (_LoneOnTensors)

    def __call__(self, input_ids: torch.Tensor, paged: PagedBatch) -> torch.Tensor:
        if input_ids.shape[0] == 1 and self.lone_traced:  # no opaque op in it: nothing reads compiled_step's slot
            return self.lone(*_lone_inputs(input_ids, paged))
        run = self.lone if input_ids.shape[0] == 1 else self.batch
        with compiled_step(paged):
            return run(input_ids, paged.positions, paged.kv_cache.kv, paged.sample_rows)


def _share(lone: PackageRunner, batch: PackageRunner, paths: dict[str, Path], may_drop: bool) -> None:
    """The batch package reads the lone one's copy of the weights where every one of its constants is the lone
    one's (shared_constants.py), else its own. Where every one is, as recorded, its own copy on disk is dropped
    (`may_drop`: under the lock)."""
    record, lone_id = paths["batch"] / SHARED, package_id(paths["lone"])
    try:
        shared, recorded = attach_constants(lone, batch, record, lone_id)
    except Exception as e:  # then each keeps its own copy, as before
        log.warning("minfer: the packages keep a copy of the weights each: %s", failure_line(e))
        batch.load_own_constants()
        return
    if shared:
        log.info("minfer: the two packages share %.0f MB of weights%s", shared / 2**20,
                 " (as recorded: the batch package's own were not read)" if recorded else "")
    else:
        log.info("minfer: the packages keep a copy of the weights each: not every one of the batch package's is the"
                 " lone one's (oneDNN's packed weights never are)")
    if may_drop and batch.blob is not None and recorded_owner(record) == lone_id:
        _drop_own_weights(batch)


BUILD_ID = "build-id"  # in each package: a name for this build of it, which no other build gets


def package_id(package: Path) -> str:
    """Which build of the package this is (a record of shared constants holds for one build of the lone package:
    one built again may differ, byte for byte)."""
    return (package / BUILD_ID).read_text()


def _drop_own_weights(batch: PackageRunner) -> None:
    """The batch package's own weights, never read again once the record names the lone package's for every one:
    out of its size record first, then off the disk (a start killed between the two finds a package as good).
    Should the lone package be built again, the batch package is built again with it (`_usable`)."""
    folder, blob = batch.package, batch.blob
    try:
        sizes = json.loads((folder / SIZES).read_text())
        sizes.pop(str(blob.relative_to(folder)), None)
        write_atomically(folder / SIZES, json.dumps(sizes, indent=1).encode())
        blob.unlink()
    except OSError as e:  # a full or read-only disk: the file stays, read by no start, and the packages serve
        log.info("minfer: the batch package keeps its own copy of the weights on disk (%s)", e.strerror or e)
        return
    batch.blob = None
    log.info("minfer: dropped the batch package's own copy of the weights (%s): it reads the lone package's",
             folder.name)


TRACED = "traced-files.json"  # in each package: the files of minfer's code its export ran, each with a hash


def _usable(kind: str, path: Path, paths: dict[str, Path]) -> None:
    """Raises ValueError where the code the package traced changed since (minfer's version names no commit), or
    where the batch package dropped its own weights for another build of the lone package."""
    try:
        traced = json.loads((path / TRACED).read_text())
    except (OSError, ValueError):
        raise ValueError(f"{TRACED} is missing or unreadable") from None
    changed = changed_files(traced) if isinstance(traced, dict) else ["?"]
    if changed:
        raise ValueError(f"the code it traced changed since ({', '.join(_shown(file) for file in changed)})")
    if kind == "batch" and own_weights(path) is None and recorded_owner(path / SHARED) != package_id(paths["lone"]):
        raise ValueError("it dropped its own weights for the lone package's, which was built again since")


def _shown(file: str) -> str:
    """A traced file as the log names it: minfer/models/gpt2.py."""
    return str(Path(file).relative_to(MINFER.parent)) if Path(file).is_relative_to(MINFER.parent) else file


def _lone_inputs(input_ids: torch.Tensor, paged: PagedBatch) -> tuple:
    """A lone decode as _LoneOnTensors takes it: each layer's cache apart, and its attention's metadata."""
    layers = list(paged.kv_cache.kv.unbind(0))
    return (input_ids, paged.positions, layers, paged.sample_rows, *lone_decode_tensors(paged.attention))


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A hash of every parameter's and buffer's values: a package holds them. Each tensor is hashed on a thread
    of its own, as many at once as torch's threads (hashlib lets go of the GIL), then its name, shape, dtype
    and hash together: 0.6 s for Qwen3-0.6B's 1.2 GB on 2 cores, against 1.8-2.8 s in one pass."""
    tensors = list(model.named_parameters()) + list(model.named_buffers())

    def values_hash(tensor: torch.Tensor) -> bytes:
        return hashlib.sha256(tensor.detach().contiguous().view(-1).view(torch.uint8).numpy()).digest()  # in place

    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        hashes = list(pool.map(values_hash, [tensor for _, tensor in tensors]))
    digest = hashlib.sha256()
    for (name, tensor), values in zip(tensors, hashes):
        digest.update(f"{name} {tuple(tensor.shape)} {tensor.dtype}".encode() + values)
    return digest.hexdigest()[:32]


def load_or_build(
    model: torch.nn.Module, opaque: OpaqueAttention, example: Callable[[str], tuple], parts: dict, options: dict,
    kinds: tuple[str, ...] = ("lone", "batch"),
) -> tuple[PackagedForward | None, CompileRecord | None, str | None]:
    """The packages for `model`: loaded from the cache, else built there from `example("lone")` and
    `example("batch")`, each a (rows, batch) of that kind (made only to build); `kinds` ("lone",): the lone
    decode's alone. Returns (the forward, how it was had, None), or (None, None, why not)."""
    start = time.perf_counter()
    root, why_off = open_cache()
    if root is None:
        return None, None, f"the compile cache is off ({why_off})"
    try:
        key = {**common_parts(), **parts, "weights": weights_fingerprint(model)}
        entry = CacheEntry(root, "whole-forward-package", key)
        paths = {kind: entry.path.with_name(f"{entry.path.stem}.{kind}") for kind in kinds}  # folders
        built, runners = [], {}
        with entry.locked() as unlocked, inductor_cache_in(root / "inductor"), templates_compiled_once():
            for number, (kind, path) in enumerate(paths.items(), 1):
                if path.exists():
                    try:
                        _usable(kind, path, paths)
                        runners[kind] = _load(path)
                        continue
                    except Exception as e:  # truncated, from another build, or stale: built again, then replaced
                        log.warning("minfer: the package %s cannot be loaded, building it again: %s", path.name, e)
                if unlocked is not None:  # built here, it could not be saved: compiled in memory instead
                    return None, None, f"the package cannot be built into the cache: {unlocked}"
                log.info("minfer: compiling the whole forward for %s into %s (package %d of %d, once) ...", kind,
                         path.name, number, len(paths))
                began = time.perf_counter()
                with freed_memory_returned():  # its frozen, packed and padded weights go back to the OS
                    options = _built(model, opaque, example(kind), kind == "lone", path, options)
                log.info("minfer: built the %s package in %.0f s", kind, time.perf_counter() - began)
                runners[kind] = _load(path)
                built.append(kind)
            runners["lone"].load_own_constants()
            if "batch" in runners:
                _share(runners["lone"], runners["batch"], paths, may_drop=unlocked is None)
    except Exception as e:  # an export the model refuses, a full disk, a package that does not load
        return None, None, failure_line(e)
    in_huge_pages_soon([t for runner in runners.values() for t in runner.constant_tensors()], "the packages' weights")
    how = "compiled" if built else "loaded"
    record = CompileRecord(how, time.perf_counter() - start, len(paths) - len(built), len(built), path=entry.path)
    return PackagedForward(runners["lone"], runners.get("batch"), opaque.backend.lone_decode_in_graph), record, None


def _load(path: Path) -> PackageRunner:
    """A package as the cache keeps it, unpacked: loaded where it lies (an archive is unpacked into a temporary
    folder first, at every start), once its files are as they were written."""
    check_sizes(path)
    return PackageRunner(path)


SIZES = "file-sizes.json"  # beside the package's own files: what each of them measured when written


def record_sizes(folder: Path) -> None:
    sizes = {str(f.relative_to(folder)): f.stat().st_size for f in sorted(folder.rglob("*")) if f.is_file()}
    (folder / SIZES).write_text(json.dumps(sizes, indent=1))


def check_sizes(folder: Path) -> None:
    """Raises ValueError where a file of the package is missing or not the size it was written at: a library cut
    short kills the process that loads it (SIGBUS), where a ValueError has the package built again."""
    record = folder / SIZES
    if not record.is_file():
        raise ValueError(f"{SIZES} is missing")
    for name, size in json.loads(record.read_text()).items():
        try:
            found = (folder / name).stat().st_size
        except FileNotFoundError:
            found = None
        if found != size:
            raise ValueError(f"{name} is {'missing' if found is None else f'{found} bytes'}, written at {size}")


def _built(model, opaque: OpaqueAttention, example: tuple, lone: bool, path: Path, options: dict) -> dict:
    """`_build`, and once more without epilogue fusion if Inductor fails: torch 2.13's C++ codegen asserted on a
    fused buffer it had removed ("AssertionError: buf22") for a Llama checkpoint with int4 weights, where without
    that fusion it compiled (GPT-2 int4 ran batch 1 3-4% slower so, hence not always). Returns the options the
    package was built with, for the next one."""
    from torch._inductor.exc import InductorError  # here: importing Inductor costs every start a second

    try:
        _build(model, opaque, *example, lone, path, options)
        return options
    except InductorError as e:
        if options.get("epilogue_fusion") is False:
            raise
        log.warning("minfer: Inductor failed (%s): building the package again without epilogue fusion", failure_line(e))
    options = {**options, "epilogue_fusion": False}
    _build(model, opaque, *example, lone, path, options)
    return options


def _build(model, opaque: OpaqueAttention, rows, batch: PagedBatch, lone: bool, path: Path, options: dict) -> None:
    """Export the step of `rows` (dynamic in its token and sampled-row counts, or a lone decode's context
    length) and package it."""
    if lone and opaque.backend.lone_decode_in_graph:
        # each layer's cache an input of its own, not a view of one, which traced_lone_decode writes in the graph
        traced = OpaqueAttention(opaque.backend, caches_are_inputs=True)
        on_tensors = _LoneOnTensors(model, replace(batch.attention, backend=traced))
        input_ids, positions, layers, *rest = _lone_inputs(rows.input_ids, batch)
        # export reads only their shapes: empty ones take no memory
        args = (input_ids, positions, [torch.empty_like(layer) for layer in layers], *rest)
        blocks = {0: torch.export.Dim("blocks_in_cache")}  # the cache's size follows the memory: not part of it
        per_layer = [blocks] * batch.kv_cache.kv.shape[0]
        shapes = (None, None, per_layer, None, None, {1: torch.export.Dim("blocks", min=2)}, None)
    else:
        on_tensors = _OnTensors(model, replace(batch.attention, backend=opaque))
        args = (rows.input_ids, rows.positions, batch.kv_cache.kv, rows.sample_rows)
        slots = {1: torch.export.Dim("slots")}  # as above
        tokens, sampled = torch.export.Dim("tokens", min=2), torch.export.Dim("sampled", min=2)
        shapes = (None, None, slots, None) if lone else ({0: tokens}, {0: tokens}, slots, {0: sampled})
    with torch.no_grad(), compiled_step(batch):
        with files_called() as traced:
            program = torch.export.export(on_tensors, args, dynamic_shapes=shapes)
        part = path.with_name(f"{path.name}.{os.getpid()}.part")
        try:
            archive = part.with_suffix(".pt2")  # AOTInductor wants the .pt2 ending
            # The constants in a file of their own: a package loads without them (shared_constants.py).
            apart = {"aot_inductor.package_constants_in_so": False, "aot_inductor.package_constants_on_disk_format":
                     "binary_blob"}
            with unique_constant_sources():
                torch._inductor.aoti_compile_and_package(program, package_path=str(archive),
                                                         inductor_configs={**options, **apart})
            with zipfile.ZipFile(archive) as package:
                package.extractall(part)
            (unpacked,) = part.iterdir()  # the archive's one top folder
            (unpacked / BUILD_ID).write_text(uuid.uuid4().hex)
            (unpacked / TRACED).write_text(json.dumps(file_hashes(traced), indent=1))
            record_sizes(unpacked)
            if path.exists():  # unreadable: replaced
                shutil.rmtree(path)
            os.replace(unpacked, path)
            _drop_build(path)
        finally:
            part.with_suffix(".pt2").unlink(missing_ok=True)
            shutil.rmtree(part, ignore_errors=True)
            _forget_export_trace()


def _forget_export_trace() -> None:
    """torch.export keeps its last trace's nodes in a map it clears only at the next export (torch 2.13): the
    traced graph, and the frozen copies of weights its module holds (GPT-2 bf16: 57 MB), would stay for good.
    Collected at once: the graph's nodes point at each other, so only the cycle collector frees them."""
    from torch.fx.experimental import proxy_tensor

    getattr(proxy_tensor, "_FAKE_TENSOR_ID_TO_PROXY_MAP_FOR_EXPORT", {}).clear()
    gc.collect()


def _drop_build(package: Path) -> None:
    """AOTInductor builds a package in Inductor's cache and copies the build into the archive, leaving it there
    too: its library and its weights, 1.5 GB a package for Qwen3-0.6B bf16. The package holds them."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    for library in package.rglob("*.so"):
        for build in Path(cache_dir()).glob(f"*/{library.name}"):  # the folder of this graph's build
            shutil.rmtree(build.parent, ignore_errors=True)
