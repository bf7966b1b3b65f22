"""The whole forward's two packages (packaged.py) keep one copy of the weights in memory.

A package keeps its constants (the frozen weights, packed for its GEMMs) in a file beside its library
(AOTInductor's "binary_blob"), so it loads without them, and copies them into memory when asked
(`load_own_constants`). The lone decode's package and the batch package hold the same packed weights: each would
keep a copy (GPT-2 bf16: 311 MB each). Both are traced from the same model with the same settings, so almost
every constant of one equals one of the other's, byte for byte. `share_constants` points each of the batch
package's constants at an equal one of the lone package's and frees the batch package's own copy; a constant with
no equal keeps a copy of its own. Only equal bytes are shared, so the package computes exactly what it did.

Comparing needs the batch package's own copy in memory for a moment. So the first start, where every constant had
an equal, writes which of the lone package's each one is (`SHARED`, naming the lone build it was found in), and
later starts hand the batch package those (`attach_constants`) without ever reading its own.

Two AOTInductor details shape it. Its runner (not the package loader) can hand out a package's constants and
swap in others: the package loads through `AOTIModelContainerRunnerCpu`. It names constants by their source,
and Inductor can give two constants it makes itself one source ("constant148" for two GEMM-packed weights of a
layer): `unique_constant_sources` names each by itself while a package builds, and a package where two
constants still share a source is left as it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch

# bytes: what a package's own constants can count on. Their offsets in its buffer are multiples of 64, but the
# buffer is malloc's (16-byte aligned; seen at 16 past a multiple of 64), so a kernel cannot rely on more.
ALIGNMENT = 16


class PackageRunner:
    """A package's library, loaded as AOTInductor's package loader loads it on a CPU, called the same way
    (the exported forward's flat tensor arguments in, its outputs back)."""

    def __init__(self, package: Path):
        from torch.utils import _pytree as pytree

        libraries = sorted(package.glob("data/aotinductor/*/*.so"))
        if len(libraries) != 1:
            raise ValueError(f"a package holds one library, this one {len(libraries)}")
        (library,) = libraries
        self.runner = torch._C._aoti.AOTIModelContainerRunnerCpu(str(library), 1)
        self._out_spec = pytree.treespec_loads(self.runner.get_call_spec()[1])  # (inputs', outputs')
        self.kept: dict[str, torch.Tensor] = {}  # constants it reads that another owns or it copied (share_constants)
        blobs = sorted(library.parent.glob("*.blob"))
        self.blob: Path | None = blobs[0] if blobs else None  # its constants, apart from its library
        self.has_constants = self.blob is None
        self.shared_by: str | None = None  # how it came to read another's constants: "record" or "comparison"

    def load_own_constants(self) -> None:
        """Its constants read from its own file, where they are kept apart from its library."""
        if not self.has_constants:
            self.runner.update_constant_buffer_from_blob(str(self.blob))  # copied in; the file's pages let go
            self.has_constants = True

    def __call__(self, *args):
        from torch.utils import _pytree as pytree

        flat = [x for x in pytree.tree_flatten((args, {}))[0] if isinstance(x, torch.Tensor)]
        return pytree.tree_unflatten(self.runner.run(flat), self._out_spec)

    def constants(self) -> dict[str, torch.Tensor] | None:
        """Its constants by name (views of its memory), or None where two share a source and cannot be told apart."""
        sources = self.runner.get_constant_names_to_original_fqns()  # name -> source
        if len(set(sources.values())) < len(sources):
            return None
        by_source = self.runner.extract_constants_map(False)
        return {name: by_source[source] for name, source in sources.items()}


def share_constants(owner: PackageRunner, sharer: PackageRunner, equals: dict[str, str] | None = None) -> int:
    """Point each of `sharer`'s constants at an equal one of `owner`'s and free `sharer`'s own copy; `equals`
    gets which of the owner's each shared one is. Returns the bytes freed (0 where nothing could be shared;
    then `sharer` is as it was)."""
    theirs, ours = owner.constants(), sharer.constants()
    if theirs is None or ours is None:
        return 0
    candidates: dict[tuple, list[tuple[str, torch.Tensor]]] = {}
    for their_name, tensor in theirs.items():
        candidates.setdefault(_layout(tensor), []).append((their_name, tensor))
    shared, names = {}, {}
    for name, tensor in ours.items():
        same = next((pair for pair in candidates.get(_layout(tensor), ()) if torch.equal(pair[1], tensor)), None)
        if same is not None and _alignment(same[1]) >= min(_alignment(tensor), ALIGNMENT):
            names[name], shared[name] = same
    if not shared:
        return 0
    # The others are copied: the package's own buffer, theirs too, is freed below. The map goes into the inactive
    # buffer, not copied (user-managed: `kept` holds the copies, the owner the rest); swapped in, the package's
    # own buffer is the inactive one and is freed.
    mapping = {name: shared[name] if name in shared else tensor.clone() for name, tensor in ours.items()}
    sharer.runner.update_constant_buffer(mapping, True, True, True)
    sharer.runner.swap_constant_buffer()
    sharer.runner.free_inactive_constant_buffer()
    sharer.kept = mapping
    if equals is not None:
        equals.update(names)
    return sum(ours[name].nbytes for name in shared)


SHARED = "shared-constants.json"  # beside the sharer's files: which of the owner's constants each of its own is


def package_id(package: Path) -> str:
    """What names one build of a package: a hash of its files' names and sizes (packaged.py records them)."""
    return hashlib.sha256((package / "file-sizes.json").read_bytes()).hexdigest()[:32]


def attach_constants(owner: PackageRunner, sharer: PackageRunner, record: Path, owner_id: str) -> tuple[int, bool]:
    """`sharer` reads `owner`'s copy of every constant they both hold: as `record` says, where it was written for
    this owner (then `sharer`'s own are never read), else by comparing (`share_constants`, `sharer`'s own read
    first), and `record` written where every one had an equal. Returns (the bytes it shares, whether `record`
    served)."""
    mapping = _recorded(owner, sharer, record, owner_id) if not sharer.has_constants else None
    if mapping is not None:
        sharer.runner.update_constant_buffer(mapping, False, True, True)  # user-managed: the owner keeps them
        sharer.kept, sharer.has_constants, sharer.shared_by = mapping, True, "record"
        return sum(t.nbytes for t in mapping.values()), True
    sharer.load_own_constants()
    equals: dict[str, str] = {}
    freed = share_constants(owner, sharer, equals)
    sharer.shared_by = "comparison" if equals else None
    if equals and len(equals) == len(sharer.runner.get_constant_names_to_original_fqns()):
        part = record.with_name(f".{record.name}.{os.getpid()}")
        try:
            part.write_text(json.dumps({"owner": owner_id, "constants": equals}, indent=1))
            os.replace(part, record)
        except OSError:  # a full or read-only cache: the next start compares again
            part.unlink(missing_ok=True)
    return freed, False


def _recorded(owner: PackageRunner, sharer: PackageRunner, record: Path, owner_id: str) -> dict | None:
    """The owner's tensor for each of the sharer's constants, as the record names them; None where there is no
    record for this owner, or it does not name every constant of the sharer's. (A sharer built again is a new
    folder, without the record.)"""
    try:
        written = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    theirs, ours = owner.constants(), sharer.runner.get_constant_names_to_original_fqns()
    names = written.get("constants") if isinstance(written, dict) and written.get("owner") == owner_id else None
    if theirs is None or not isinstance(names, dict) or set(names) != set(ours):
        return None
    if not set(names.values()) <= set(theirs):
        return None
    return {name: theirs[names[name]] for name in names}


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
