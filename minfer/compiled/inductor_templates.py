"""Inductor's C++ kernel templates, each compiled from its jinja2 source once per build, not at every use.

torch 2.13's `KernelTemplate._template_from_string` makes a new jinja2 Environment and compiles a template's
source each time it writes a GEMM's kernel or micro-kernel. GPT-2 124M's two bf16 packages on an AMX CPU
compiled 32 sources 2,277 times: 12.2 s of a first start's ~100 s. A compiled template depends on its source
alone (each call's values go to `render`), so one per source serves the whole build.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Iterator

_lock = threading.Lock()
_builds = 0  # bodies running under templates_compiled_once, on any thread
_torch_function: Any = None  # torch's own, while ours stands in for it
_compiled: dict[str, Any] = {}  # source -> its template, while any build runs


@contextmanager
def templates_compiled_once() -> Iterator[None]:
    """While the body builds, each template source is compiled once; torch's own function is back when the
    last build that overlaps it ends. A torch without the function builds as it always does."""
    from torch._inductor.codegen.common import KernelTemplate  # here: importing Inductor costs a second

    global _builds, _torch_function
    if not hasattr(KernelTemplate, "_template_from_string"):
        yield
        return
    with _lock:
        if _builds == 0:
            _torch_function = KernelTemplate.__dict__["_template_from_string"]
            KernelTemplate._template_from_string = staticmethod(_compiled_once)
        _builds += 1
    try:
        yield
    finally:
        with _lock:
            _builds -= 1
            if _builds == 0:
                KernelTemplate._template_from_string = _torch_function
                _compiled.clear()


def _compiled_once(source: str) -> Any:
    template = _compiled.get(source)
    if template is None:  # two threads may both compile a source: either template serves
        template = _compiled[source] = _torch_function.__func__(source)
    return template
