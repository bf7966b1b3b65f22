"""Inductor's C++ kernel templates, each compiled from its jinja2 source once per build, not at every use.

torch 2.13's `KernelTemplate._template_from_string` makes a new jinja2 Environment and compiles a template's
source each time it writes a GEMM's kernel or micro-kernel. GPT-2 124M's two bf16 packages on an AMX CPU
compiled 32 sources 2,277 times: 12.2 s of a first start's ~100 s. A compiled template depends on its source
alone (each call's values go to `render`), so one per source serves the whole build.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator


@contextmanager
def templates_compiled_once() -> Iterator[None]:
    """While the body builds, each template source is compiled once; torch's own function is back after.
    A torch without the function builds as it always does."""
    from torch._inductor.codegen.common import KernelTemplate  # here: importing Inductor costs a second

    compile_source: Callable[[str], Any] | None = getattr(KernelTemplate, "_template_from_string", None)
    if compile_source is None:
        yield
        return
    compiled: dict[str, Any] = {}

    def compiled_once(source: str) -> Any:
        if source not in compiled:
            compiled[source] = compile_source(source)
        return compiled[source]

    KernelTemplate._template_from_string = staticmethod(compiled_once)
    try:
        yield
    finally:
        KernelTemplate._template_from_string = staticmethod(compile_source)
