"""The whole forward's two packages (packaged.py) keep one copy of the weights in memory.

A package copies its constants (the frozen weights, packed for its GEMMs) into memory as it loads, and the lone
decode's package and the batch package hold the same packed weights: each would keep a copy (GPT-2 bf16: 311 MB
each). Both are traced from the same model with the same settings, so almost every constant of one equals one of
the other's, byte for byte. `share_constants` points each of the batch package's constants at an equal one of the
lone package's and frees the batch package's own copy; a constant with no equal keeps a copy of its own. Only
equal bytes are shared, so the package computes exactly what it did. And the runner copies the constants out of
the package's library, whose pages stay resident as the file's (counted again in the process's resident size):
`drop_mapped_constants` lets them go.

Two AOTInductor details shape it. Its runner (not the package loader) can hand out a package's constants and
swap in others: the package loads through `AOTIModelContainerRunnerCpu`. It names constants by their source,
and Inductor can give two constants it makes itself one source ("constant148" for two GEMM-packed weights of a
layer): `unique_constant_sources` names each by itself while a package builds, and a package where two
constants still share a source is left as it is.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import sys
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
        drop_mapped_constants(library)
        self._out_spec = pytree.treespec_loads(self.runner.get_call_spec()[1])  # (inputs', outputs')
        self.kept: dict[str, torch.Tensor] = {}  # constants it reads that another owns or it copied (share_constants)

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


def share_constants(owner: PackageRunner, sharer: PackageRunner) -> int:
    """Point each of `sharer`'s constants at an equal one of `owner`'s and free `sharer`'s own copy. Returns
    the bytes freed (0 where nothing could be shared; then `sharer` is as it was)."""
    theirs, ours = owner.constants(), sharer.constants()
    if theirs is None or ours is None:
        return 0
    candidates: dict[tuple, list[torch.Tensor]] = {}
    for tensor in theirs.values():
        candidates.setdefault(_layout(tensor), []).append(tensor)
    shared = {}
    for name, tensor in ours.items():
        same = next((t for t in candidates.get(_layout(tensor), ()) if torch.equal(t, tensor)), None)
        if same is not None and _alignment(same) >= min(_alignment(tensor), ALIGNMENT):
            shared[name] = same
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
    return sum(ours[name].nbytes for name in shared)


MADV_DONTNEED = 4  # Linux's madvise advice: drop these pages (a file's are read again if touched)


def drop_mapped_constants(library: Path) -> int:
    """The pages of the library's large read-only mappings leave memory: its constants, which the runner has
    copied into memory of its own as it loaded (the copy that serves), else counted twice in the process's
    resident size (Qwen3-0.6B bf16: 1.5 GB a package). They are the file's own pages, so touching them again
    only reads the file. Linux only; elsewhere, or where madvise refuses, they stay. Returns the bytes dropped."""
    if not sys.platform.startswith("linux"):
        return 0
    name, dropped = os.path.realpath(library), 0
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return 0
    for line in maps:
        fields = line.split(maxsplit=5)  # address perms offset device inode path
        if len(fields) == 6 and fields[1] == "r--p" and fields[5] == name:
            start, end = (int(address, 16) for address in fields[0].split("-"))
            if end - start >= 1 << 20 and libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start),
                                                       MADV_DONTNEED) == 0:
                dropped += end - start
    return dropped


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
