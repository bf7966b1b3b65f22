"""Plugs an exercise's functions into the real engine, in place of minfer's own, and checks they ran.

A stage script calls `plug("07")` near its top and `.graded()` at its end:

    exercise = plug("07")   # nothing happens unless --exercise or MINFER_EXERCISE asks for it
    ...                     # the stage runs, and its asserts grade whatever ran
    exercise.graded()       # every plugged function must have been called

Each exercise names the attributes it replaces (`BlockAllocator.allocate`, ...) and the stub function
that replaces each one. The functions come from the learner's file (`exercises/exNN_*.py`) or, for the
tests, from `exercises/reference.py`, which hands back minfer's own code under the stubs' names: both
go through this same path, so the grader cannot drift away from the engine it grades.

Three ways an exercise fails loudly instead of passing by accident:
- a stub still raises NotImplementedError: the run stops with a sentence naming the file to fill in;
- the attribute it replaces is gone (minfer renamed it): the plug refuses, naming it;
- a plugged function never ran (the engine stopped calling it): `graded()` fails, naming it.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path

EXERCISES_DIR = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Seam:
    """One place an exercise plugs in: `owner.attribute` (owner a class, or a script's globals by the name
    "script"), replaced by the stub's function `function`, whose reference is `reference` in minfer."""

    owner: str  # "minfer.engine.block_allocator:BlockAllocator", or "script" for the stage's own globals
    attribute: str
    function: str  # the stub's function name
    reference: str  # where minfer's own version lives, for the learner to compare
    in_thread: bool = False  # runs as a thread's target: an error there must end the whole run


@dataclass(frozen=True)
class Exercise:
    stage: str
    module: str  # the stub's module in tutorials/exercises/
    seams: tuple[Seam, ...]


ALLOCATOR = "minfer.engine.block_allocator:BlockAllocator"
BATCHER = "minfer.engine.continuous_batcher:ContinuousBatcher"
TORCH_BACKEND = "minfer.attention.torch_sdpa:TorchBackend"
MANAGER = "minfer.server.manager:SchedulerManager"

EXERCISES = {
    e.stage: e
    for e in (
        Exercise("03", "ex03_kv_cache", (
            Seam("script", "attention_with_cache", "attention_with_cache",
                 "TorchBackend.prefill_chunk and TorchBackend.prefill_attention in minfer/attention/torch_sdpa.py"),
        )),
        Exercise("07", "ex07_block_allocator", (
            Seam(ALLOCATOR, "allocate", "allocate", "BlockAllocator.allocate in minfer/engine/block_allocator.py"),
            Seam(ALLOCATOR, "free", "free", "BlockAllocator.free in minfer/engine/block_allocator.py"),
        )),
        Exercise("08", "ex08_paged_attention", (
            Seam(TORCH_BACKEND, "forward", "forward", "TorchBackend.forward in minfer/attention/torch_sdpa.py"),
        )),
        Exercise("09", "ex09_prefix_caching", (
            Seam(ALLOCATOR, "register_full_blocks", "register_full_blocks",
                 "BlockAllocator.register_full_blocks in minfer/engine/block_allocator.py"),
            Seam(ALLOCATOR, "match_prefix", "match_prefix",
                 "BlockAllocator.match_prefix in minfer/engine/block_allocator.py"),
        )),
        Exercise("10", "ex10_scheduler", (
            Seam(BATCHER, "_admit", "admit", "ContinuousBatcher._admit in minfer/engine/continuous_batcher.py"),
            Seam(BATCHER, "_preempt", "preempt", "ContinuousBatcher._preempt in minfer/engine/continuous_batcher.py"),
        )),
        Exercise("11", "ex11_worker_loop", (
            Seam(MANAGER, "_run", "run", "SchedulerManager._run in minfer/server/manager.py", in_thread=True),
        )),
    )
}


class ExerciseError(SystemExit):
    """Ends a stage with one clear sentence (a SystemExit: the engine's `except Exception` lets it through)."""


@dataclass
class Plugged:
    """What `plug` did: the functions it put in place, and how often each ran."""

    exercise: Exercise | None = None
    source: str = ""  # "yours" or "reference"
    calls: dict[str, int] = field(default_factory=dict)  # seam label -> calls

    def graded(self) -> None:
        """At the end of a stage: every plugged function ran, so the stage's asserts graded it."""
        if self.exercise is None:
            return
        idle = [label for label, n in self.calls.items() if n == 0]
        if idle:
            raise ExerciseError(
                f"exercise {self.exercise.stage}: {', '.join(idle)} never ran during the stage: the engine no "
                "longer calls it, so nothing graded it (tutorials/exercises/plug.py names where each plugs in)"
            )
        counts = ", ".join(f"{label} ran {n} time{'s' * (n != 1)}" for label, n in self.calls.items())
        who = "your code" if self.source == "yours" else "the reference"
        print(f"\nexercise {self.exercise.stage} graded ({who}): {counts}; every assert above passed with it")


def resolve(owner: str, namespace: dict | None):
    """The object whose attribute a seam replaces: a class in minfer, or the stage script's globals."""
    if owner == "script":
        if namespace is None:
            raise ValueError("this exercise plugs into the stage script: call plug(stage, globals())")
        return namespace
    module, _, name = owner.partition(":")
    return getattr(importlib.import_module(module), name)


def load_functions(exercise: Exercise, source: str):
    """The module that provides the exercise's functions: the learner's stub file, or the reference."""
    sys.path.insert(0, str(EXERCISES_DIR.parent))  # tutorials/, so `exercises` imports as a package
    if source == "reference":
        from exercises import reference

        return reference.solutions(exercise.stage)
    module = importlib.import_module(f"exercises.{exercise.module}")
    return {seam.function: getattr(module, seam.function) for seam in exercise.seams}


def counted(exercise: Exercise, seam: Seam, function, calls: dict[str, int], label: str):
    """`function`, counting its calls and turning a stub's NotImplementedError into a clear ending."""
    stub_file = f"tutorials/exercises/{exercise.module}.py"

    def unwritten() -> str:
        return (
            f"exercise {exercise.stage}: {seam.function} is not written yet: fill in {stub_file} "
            f"(minfer's own is {seam.reference}; run the stage without --exercise to see it pass)"
        )

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        calls[label] += 1
        try:
            return function(*args, **kwargs)
        except NotImplementedError:
            if not seam.in_thread:
                raise ExerciseError(unwritten()) from None
            print(unwritten(), file=sys.stderr, flush=True)
            os._exit(1)
        except BaseException:
            if not seam.in_thread or threading.current_thread() is threading.main_thread():
                raise
            # An error in a thread would leave the stage waiting on events that never come.
            traceback.print_exc()
            print(f"exercise {exercise.stage}: {seam.function} raised in its thread (above)", file=sys.stderr,
                  flush=True)
            os._exit(1)

    return wrapper


def plug(stage: str, namespace: dict | None, source: str | None) -> Plugged:
    """Replace minfer's functions by the exercise's for the rest of this process. source: "yours" (the
    learner's file), "reference" (minfer's own, through the same path), or None (plug nothing)."""
    if source is None:
        return Plugged()
    exercise = EXERCISES[stage]
    functions = load_functions(exercise, source)
    plugged = Plugged(exercise, source)
    for seam in exercise.seams:
        owner = resolve(seam.owner, namespace)
        label = f"{seam.attribute} (the script's)" if seam.owner == "script" else f"{owner.__name__}.{seam.attribute}"
        present = seam.attribute in owner if isinstance(owner, dict) else hasattr(owner, seam.attribute)
        if not present:
            raise ExerciseError(
                f"exercise {stage} plugs into {label}, which no longer exists: minfer moved it, and "
                "tutorials/exercises/plug.py (with the stub and reference.py) must follow"
            )
        plugged.calls[label] = 0
        wrapper = counted(exercise, seam, functions[seam.function], plugged.calls, label)
        if isinstance(owner, dict):
            owner[seam.attribute] = wrapper
        else:
            setattr(owner, seam.attribute, wrapper)
    who = "your code" if source == "yours" else "the reference (minfer's own, through the plug)"
    print(f"exercise {stage}: {who} replaces {', '.join(plugged.calls)}")
    return plugged
