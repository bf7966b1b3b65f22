"""A torch.compile'd function whose warm-up graphs can be saved to disk and loaded by a later start.

torch.compile keeps what it compiled in the process: every start traces the function again with Dynamo
(most of a warm start, even when Inductor's own on-disk caches hold the kernels), and a start that loads
nothing compiles everything. torch's ahead-of-time precompile (`aot_compile`, the path vLLM's compile cache
takes) compiles one graph for one call's inputs and serializes all of it: Dynamo's bytecode, its guards,
the AOTAutograd and Inductor output. `PrecompiledFunction` keeps a list of such graphs and plays
Dynamo's part itself: a call runs the first graph whose guards accept its inputs. `serialized()` and
`load()` move the list to and from bytes; saved_graphs.py decides where those live and when to read and
write them, and sets `precompiling` while a warm-up runs.

- While `precompiling`, a call that no graph accepts precompiles one more, to be saved.
- Otherwise (after the warm-up, or with the cache off) it goes to torch.compile, in memory, as it did
  before there was a cache: Dynamo's own recompiles, whose kernels Inductor's FX graph cache may hold. (A
  precompile never hits that cache: each one names its graph afresh.)
- Where the precompile fails (a torch without it, a graph it cannot serialize), torch.compile serves from
  then on, and `not_saved` says why: the cache never costs a compiled path.

Inductor's C++ kernels are compiled from the source a graph carries, into Inductor's cache directory, and
loaded from there; saved_graphs.py points that directory into minfer's own cache while it compiles and
loads, so that native code is only ever loaded from a directory no one else can write.
"""

from __future__ import annotations

import inspect
import io
import logging
import pickle
import time
from collections.abc import Callable

import torch

log = logging.getLogger("minfer")

MAX_GRAPHS = 16  # graphs a warm-up may precompile for one function; past it, calls go to torch.compile


def compile_for_cpu(fn, **inductor_options):
    """torch.compile(fn) as minfer serves it: dynamic shapes (batch sizes and context lengths never
    recompile), and free to run at any thread count. CpuShare (cpu/thread_share.py) changes torch's thread
    count while serving; the C++ loops ask OpenMP for it at run time (cpp.dynamic_threads) instead of
    baking it in, so Dynamo's guard on the global state, which holds the thread count, is dropped:
    otherwise each new count would compile every graph once more, mid-request. (The guards on grad
    mode and the other settings, which are separate, stay.)"""
    options = {"cpp.dynamic_threads": True, "guard_filter_fn": _not_global_state, **inductor_options}
    return torch.compile(fn, dynamic=True, options=options)


def _not_global_state(guards) -> list[bool]:
    return [guard.guard_type != "GLOBAL_STATE" for guard in guards]


def _saved_guards(guards) -> list[bool]:
    """The guards a saved graph keeps: not the global state (see compile_for_cpu), none that name an object
    of this process (its id, a module, a closure), which cannot be saved, and none on a weight oneDNN
    packed (cpu/packing.py), which cannot be pickled. What those stand for, the code, the settings and the
    weights' shapes the graph was compiled from, is checked by the cache's key (cache_key.py)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsaved = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES) | {"GLOBAL_STATE"}
    return [
        not (g.is_global or g.guard_type in unsaved or unsaved.intersection(g.derived_guard_types) or _packed(g))
        for g in guards
    ]


def _packed(guard) -> bool:
    return guard.has_value and isinstance(guard.value, torch.Tensor) and guard.value.layout == torch._mkldnn


class PrecompiledFunction:
    """Called as `fn` is; runs it through precompiled graphs that can be saved (`serialized`) and loaded
    (`load`), or through torch.compile (see the module's docstring). Dynamic shapes, as compile_for_cpu
    compiles: batch sizes and context lengths reuse a graph."""

    def __init__(self, fn: Callable, what: str, **inductor_options):
        self.fn, self.what = fn, what
        self.inductor_options = inductor_options
        options = {"cpp.dynamic_threads": True, **inductor_options, "guard_filter_fn": _saved_guards}
        self._compiler = torch.compile(fn, dynamic=True, fullgraph=True, options=options)
        self._names = list(inspect.signature(fn).parameters)
        self.graphs: list = []  # torch._dynamo.aot_compile.AOTCompiledFunction, in the order made or loaded
        self._pending: list[bytes] = []  # graphs `load` took, rebuilt at the next call
        self.num_loaded = 0  # of which loaded from bytes
        self.num_compiled = 0  # of which precompiled in this process
        self.precompiling = False  # a warm-up whose graphs are saved is running (saved_graphs.py)
        self.not_saved: str | None = None  # why the precompile failed, where it did
        self._in_memory: Callable | None = None  # torch.compile(fn), made at its first call

    def __call__(self, *args):
        if torch.compiler.is_compiling():  # traced into a larger graph: the plain function, for it to fuse
            return self.fn(*args)
        if self.not_saved is not None:
            return self.in_memory(*args)
        # A float argument (attention's scale) as a 0-d tensor: one graph serves every value. (A float would be
        # a constant of the graph: the precompile cannot turn it into an input midway, as Dynamo's own loop does.)
        tensors = tuple(torch.tensor(a) if type(a) is float else a for a in args)
        if self._pending:
            self._load_pending()
        # The guards read the call's arguments by name, as in Dynamo's frame. (AOTCompiledFunction.__call__
        # checks them too, binding the arguments through inspect: 15-20 us a call more.)
        inputs = dict(zip(self._names, tensors))
        for graph in self.graphs:
            if _accepts(graph, inputs):
                return graph.fn(*tensors)
        if self.precompiling and len(self.graphs) < MAX_GRAPHS:
            graph = self._precompile(tensors)
            if graph is not None:
                return graph.fn(*tensors)
        elif self.graphs and self._in_memory is None:  # torch.compile's first graph, where Dynamo checks none
            import torch._dynamo.config as dynamo_config

            if dynamo_config.error_on_recompile:  # as Dynamo's own recompiles do (the tests' check)
                raise torch._dynamo.exc.RecompileError(f"{self.what}: no compiled graph's guards accept this call")
        return self.in_memory(*args)

    @property
    def in_memory(self) -> Callable:
        """torch.compile(fn): for calls no saved graph serves."""
        if self._in_memory is None:
            self._in_memory = compile_for_cpu(self.fn, **self.inductor_options)
        return self._in_memory

    def _precompile(self, args: tuple):
        """One more graph, for inputs like `args`; a log line as it starts and one as it ends: a cold start
        shows its progress piece by piece. None where the precompile failed."""
        import torch._dynamo.config as dynamo_config

        number = len(self.graphs) + 1
        log.info("minfer: compiling %s, graph %d ...", self.what, number)
        start = time.perf_counter()
        try:
            # Floats it reads (a layer norm's eps) as constants, for the reason in `__call__`.
            with dynamo_config.patch(specialize_float=True):
                graph = self._compiler.aot_compile((args, {}))
            if not _accepts(graph, dict(zip(self._names, args))):
                raise RuntimeError("its guards refuse the inputs it was compiled for")
        except Exception as e:  # a torch without the precompile, a graph it cannot save: torch.compile
            self.not_saved = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            log.warning("minfer: %s cannot be precompiled for the compile cache (%s): compiling it in memory",
                        self.what, self.not_saved)
            return None
        self.graphs.append(graph)
        self.num_compiled += 1
        log.info("minfer: compiled %s, graph %d, in %.1f s", self.what, number, time.perf_counter() - start)
        return graph

    def __reduce__(self):
        """Pickled empty. A saved graph records the inputs its guards read, and while a block's graph runs,
        the block's `forward` calls this function (step.py); no guard reads what is inside it."""
        return object.__new__, (PrecompiledFunction,)

    def serialized(self) -> bytes:
        """Every graph this function holds, as bytes `load` takes back."""
        from torch._dynamo.aot_compile import AOTCompiledFunction

        return pickle.dumps([AOTCompiledFunction.serialize(g).serialized_data for g in self.graphs])

    def load(self, data: bytes) -> None:
        """Take the graphs `serialized` wrote, ahead of any this function holds. They are rebuilt at the first
        call, under that call's dispatch state: a graph's guards on its inputs' dispatch keys are remade as
        it loads, against the state of the moment (inference mode, for every minfer step)."""
        self._pending = list(pickle.loads(data))

    def _load_pending(self) -> None:
        pending, self._pending = self._pending, []
        try:
            graphs = [torch.compiler.load_compiled_function(io.BytesIO(g), f_globals=self.fn.__globals__)
                      for g in pending]
        except Exception as e:  # corrupt, or from another build: compiled afresh (and saved over)
            log.warning("minfer: the saved graphs of %s are unreadable, compiling afresh: %s", self.what,
                        f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
            return
        self.graphs[:0] = graphs
        self.num_loaded += len(graphs)


def _accepts(graph, inputs: dict) -> bool:
    """Whether a precompiled graph's guards accept a call's arguments (torch's own check, called directly)."""
    return graph._artifacts.guard_manager.check(inputs)
