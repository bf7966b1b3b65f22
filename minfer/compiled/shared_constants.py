"""The whole forward's two packages (packaged.py) keep one copy of the weights in memory, where they can.

A package keeps its constants (the frozen weights, packed for its GEMMs) in a file beside its library
(AOTInductor's "binary_blob"), so it loads without them. The lone decode's package copies its own into memory
(`load_own_constants`). The batch package is traced from the same model with the same settings, so its constants
are the lone one's, byte for byte, where both packages packed a weight alike. `attach_constants` hands the batch
package the lone one's tensor for each (`equal_constants`: same bytes, dtype, shape and strides, aligned as its
own would be) where every one of its constants has an equal: only equal bytes are shared, so it computes exactly
what it would with its own. Where timing chose ATen's GEMM for a layer (without AMX it can choose it for all, bf16
too), that weight is oneDNN's packed tensor, with no equal: the batch package then reads its own file, whole.
Sharing the rest would save a quarter of the weights (the embedding tables) and cost a warm start a second read of
its file and a copy of the packed weights (Qwen3-0.6B bf16: 4.7 s of 15, to save 297 MB).

Finding the equals means reading the batch package's own file: that is done once, by a second runner of its
library that is let go after, and the verdict is recorded beside the package (`SHARED`, naming the lone build it
was made with): which of the lone package's each constant is, or that the batch package reads its own. Later
starts read the record, and a batch package that shares every constant never reads its file.

Two AOTInductor details shape it. Its runner (not the package loader) can hand out a package's constants and
take others: packages load through `AOTIModelContainerRunnerCpu`. It names constants by their source, and
Inductor can give two constants it makes itself one source ("constant148" for two GEMM-packed weights of a
layer): `unique_constant_sources` names each by itself while a package builds, and a package where two
constants still share a source reads its own.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from .artifacts import write_atomically

# bytes: what a package's own constants can count on. Their offsets in its buffer are multiples of 64, but the
# buffer is malloc's (16-byte aligned; seen at 16 past a multiple of 64), so a kernel cannot rely on more.
ALIGNMENT = 16


class PackageRunner:
    """A package's library, loaded as AOTInductor's package loader loads it on a CPU, called the same way
    (the exported forward's flat tensor arguments in, its outputs back). Its constants are in a file apart: it
    holds none until given some (`load_own_constants`, `attach_constants`)."""

    def __init__(self, package: Path):
        from torch.utils import _pytree as pytree

        libraries = sorted(package.glob("data/aotinductor/*/*.so"))
        if len(libraries) != 1:
            raise ValueError(f"a package holds one library, this one {len(libraries)}")
        self.package, self.blob = package, own_weights(package)  # None: dropped, another's serve (SHARED)
        self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(libraries[0]), 1)
        self._out_spec = pytree.treespec_loads(self.runner.get_call_spec()[1])  # (inputs', outputs')
        self.kept: dict[str, torch.Tensor] = {}  # the constants it reads, where another owns them (attach_constants)
        self.shared_by: str | None = None  # how it came to read another's constants: "record" or "comparison"

    def load_own_constants(self) -> None:
        """Its constants, copied into memory from its file (whose pages the runner lets go)."""
        if self.blob is None:
            raise ValueError(f"{self.package.name} dropped its own weights: it reads another package's")
        self.runner.update_constant_buffer_from_blob(str(self.blob))

    def reader(self) -> "PackageRunner":
        """Another runner of the same package, to read its own constants with and let go."""
        return PackageRunner(self.package)

    def __call__(self, *args):
        from torch.utils import _pytree as pytree

        flat = [x for x in pytree.tree_flatten((args, {}))[0] if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.runner.run(flat), self._out_spec)

    def constant_tensors(self) -> list[torch.Tensor]:
        """Every constant it reads (views of the memory that holds them), whatever their names."""
        return list(self.runner.extract_constants_map(False).values())

    def constants(self) -> dict[str, torch.Tensor] | None:
        """Its constants by name (views of its memory), or None where two share a source and cannot be told apart."""
        sources = self.runner.get_constant_names_to_original_fqns()  # name -> source
        if len(set(sources.values())) < len(sources):
            return None
        by_source = self.runner.extract_constants_map(False)
        return {name: by_source[source] for name, source in sources.items()}


def equal_constants(theirs: dict[str, torch.Tensor], ours: dict[str, torch.Tensor]) -> dict[str, str]:
    """For each of `ours` with an equal among `theirs` (the same bytes, dtype, shape and strides, at an address as
    aligned as ours is sure to be), the name of that one. Only plain (strided) tensors are compared: a weight
    oneDNN packed for an ATen GEMM (an fp32 package's, where timing chose that kernel) has none."""
    candidates: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for their_name, tensor in theirs.items():
        if tensor.layout == torch.strided:
            candidates.setdefault(_layout(tensor), []).append((their_name, tensor))
    equals = {}
    for name, tensor in ours.items():
        if tensor.layout != torch.strided:
            continue
        same = next((pair for pair in candidates.get(_layout(tensor), ()) if torch.equal(pair[1], tensor)), None)
        if same is not None and _alignment(same[1]) >= min(_alignment(tensor), ALIGNMENT):
            equals[name] = same[0]
    return equals


SHARED = "shared-constants.json"  # beside the sharer's files: which of the owner's constants each of its own is,
# or READS_OWN


def own_weights(package: Path) -> Path | None:
    """The package's file of constants, beside its library; None where it was dropped (packaged.py)."""
    return next(iter(sorted(package.glob("data/aotinductor/*/*.blob"))), None)


def recorded_owner(record: Path) -> str | None:
    """The owner build whose constants a record gives the sharer, every one; None where there is no readable
    record, or it says the sharer reads its own."""
    written = _read_record(record)
    return written.get("owner") if written is not None and isinstance(written.get("constants"), dict) else None


READS_OWN = "reads its own"  # a record's verdict where some constant of the sharer's has no equal


def attach_constants(owner: PackageRunner, sharer: PackageRunner, record: Path, owner_id: str) -> tuple[int, bool]:
    """Give `sharer` (holding no constants yet) `owner`'s tensor for every one of its constants, where each has an
    equal; else it reads its own file. Which, as `record` says where it was written for this owner, else found by
    comparing, and recorded. Returns (the bytes it shares, whether the record served)."""
    theirs = owner.constants()
    names = _recorded(record, owner_id, theirs, sharer) if theirs is not None else None
    recorded = names is not None
    if not recorded and theirs is not None:
        names = _compared(theirs, sharer)
        _write_record(record, owner_id, names)
    if names is None or names == READS_OWN:
        sharer.load_own_constants()
        return 0, recorded
    mapping = {name: theirs[their_name] for name, their_name in names.items()}
    sharer.runner.update_constant_buffer(mapping, False, True, True)  # user-managed: they stay where they are
    sharer.kept, sharer.shared_by = mapping, "record" if recorded else "comparison"
    return sum(tensor.nbytes for tensor in mapping.values()), recorded


def _compared(theirs: dict[str, torch.Tensor], sharer: PackageRunner) -> dict[str, str] | str:
    """Which of the owner's constants each of the sharer's equals, found by a runner of the sharer's own that reads
    its file and goes when this returns; READS_OWN where some constant has no equal, or they cannot be told apart."""
    reader = sharer.reader()
    reader.load_own_constants()
    ours = reader.constants()
    if ours is None:
        return READS_OWN
    names = equal_constants(theirs, ours)
    return names if len(names) == len(ours) else READS_OWN


def _recorded(record: Path, owner_id: str, theirs: dict, sharer: PackageRunner) -> dict[str, str] | str | None:
    """The record's verdict for this owner: which of the owner's constants each of the sharer's is (every one of
    the sharer's, each one of `theirs`), or READS_OWN; None where there is no such record. (A sharer built again is
    a new folder, without the record.)"""
    written = _read_record(record)
    if written is None or written.get("owner") != owner_id:
        return None
    names = written.get("constants")
    if names == READS_OWN:
        return READS_OWN
    if not isinstance(names, dict) or set(names) != set(sharer.runner.get_constant_names_to_original_fqns()):
        return None
    return names if set(names.values()) <= set(theirs) else None


def _read_record(record: Path) -> dict | None:
    try:
        written = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return written if isinstance(written, dict) else None


def _write_record(record: Path, owner_id: str, names: dict[str, str] | str) -> None:
    with contextlib.suppress(OSError):  # a full or read-only cache: the next start compares again
        write_atomically(record, json.dumps({"owner": owner_id, "constants": names}, indent=1).encode())


def _layout(tensor: torch.Tensor) -> tuple:
    return tensor.dtype, tuple(tensor.shape), tuple(tensor.stride())


def _alignment(tensor: torch.Tensor) -> int:
    """The largest power of two, up to ALIGNMENT, that the tensor's address is a multiple of."""
    address = tensor.data_ptr()
    return min(ALIGNMENT, address & -address) if address else ALIGNMENT


@contextlib.contextmanager
def unique_constant_sources() -> Iterator[None]:
    """While a package builds: a constant Inductor makes itself (a GEMM's packed weight) has its own name as its
    source. Inductor names such a constant by how many it holds, which after some were folded away can be the
    name of one it holds; the new one then gets a suffix ("constant148_0") but keeps the taken name as its
    source, so the package's runner hands out one of the two by that source. Where Inductor has no such method,
    nothing changes (and `PackageRunner.constants` sees the clash)."""
    from torch._inductor.graph import GraphLowering

    allocate = getattr(GraphLowering, "allocate_non_dup_const_name", None)
    if allocate is None:
        yield
        return

    def allocate_unique(self, name, data):
        unique = allocate(self, name, data)
        sources = getattr(self, "allocated_constant_name", {})
        if name is None and sources.get(unique, "").startswith("constant"):  # one it named, not a parameter
            sources[unique] = unique
        return unique

    GraphLowering.allocate_non_dup_const_name = allocate_unique
    try:
        yield
    finally:
        GraphLowering.allocate_non_dup_const_name = allocate
