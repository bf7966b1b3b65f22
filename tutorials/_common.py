"""Helpers shared by the tutorial scripts (each script runs as `python tutorials/NN_name.py`,
so this folder is on sys.path and `from _common import model_path` works)."""

import os
import sys


def model_path() -> str:
    """The checkpoint directory the tutorials run on, in this order of preference:

    1. MINFER_MODEL, if set (a local directory or a Hub id such as gpt2-medium);
    2. the real gpt2, if the Hub or the local Hugging Face cache has it;
    3. minfer-tiny, the small GPT-2 minfer ships (trained on simple stories: it writes those, and
       knows only their words), so the tutorials run offline with readable output.

    Prints one line saying which model it picked.
    """
    from minfer.models.loader import ModelNotFoundError, resolve_model_dir

    if os.environ.get("MINFER_MODEL"):
        path = resolve_model_dir(os.environ["MINFER_MODEL"])
        print(f"model: {path} (from MINFER_MODEL)")
        return str(path)
    try:
        path = resolve_model_dir("gpt2")
        print(f"model: gpt2 ({path})")
        return str(path)
    except ModelNotFoundError:
        pass
    path = resolve_model_dir("minfer-tiny")
    print(f"model: minfer-tiny, shipped with minfer ({path}; gpt2 not available; set MINFER_MODEL to choose)")
    return str(path)


def section(title: str) -> None:
    """Print a heading, so a script's output reads as the chapter does."""
    print(f"\n== {title} ==")


def exercise_source() -> str | None:
    """Whose code a stage with an exercise runs in place of minfer's (tutorials/exercises/):
    None, minfer's own (the default); "yours", the stub you filled in (`--exercise`, or
    MINFER_EXERCISE=1); "reference", minfer's own through the exercise's plug (`--exercise=reference`,
    or MINFER_EXERCISE=reference: what the tests run)."""
    flags = [arg for arg in sys.argv[1:] if arg == "--exercise" or arg.startswith("--exercise=")]
    value = (flags[-1].partition("=")[2] or "yours") if flags else os.environ.get("MINFER_EXERCISE", "")
    value = {"": None, "0": None, "1": "yours", "yours": "yours", "reference": "reference"}.get(value.lower(), value)
    if value not in (None, "yours", "reference"):
        raise SystemExit(f"--exercise / MINFER_EXERCISE must be 1 (your code) or reference, got {value!r}")
    return value


def refuse_an_exercise_flag_where_there_is_none() -> None:
    """`--exercise` on a stage without an exercise would run minfer's own code and pass: say there is none."""
    if not any(arg == "--exercise" or arg.startswith("--exercise=") for arg in sys.argv[1:]):
        return
    from exercises.plug import EXERCISES

    stage = os.path.basename(sys.argv[0]).split("_", 1)[0]
    if stage not in EXERCISES:
        raise SystemExit(f"stage {stage} has no exercise (--exercise): stages {', '.join(sorted(EXERCISES))} "
                         "have one (tutorials/README.md)")


refuse_an_exercise_flag_where_there_is_none()  # as each stage imports this module, before it loads a model


def exercise(stage: str, namespace: dict | None = None):
    """Plug the stage's exercise into the engine if --exercise or MINFER_EXERCISE asks (else do nothing);
    call .graded() on the result at the stage's end. namespace: the script's globals, for an exercise
    that replaces one of the script's own functions."""
    from exercises.plug import plug

    return plug(stage, namespace, exercise_source())
