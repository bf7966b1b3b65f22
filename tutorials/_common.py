"""Helpers shared by the tutorial scripts (each script runs as `python tutorials/NN_name.py`,
so this folder is on sys.path and `from _common import model_path` works)."""

import os
import shutil
import tempfile
from pathlib import Path

# Where the fallback random checkpoint is written, once, and reused by every later run.
TINY_DIR = Path(tempfile.gettempdir()) / "minfer-tutorials-tiny"


def model_path() -> str:
    """The checkpoint directory the tutorials run on, in this order of preference:

    1. MINFER_MODEL, if set (a local directory or a Hub id such as gpt2-medium);
    2. the real gpt2, if the Hub or the local Hugging Face cache has it;
    3. a tiny GPT-2 with random weights, written once under the temp folder.

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
    if not (TINY_DIR / "config.json").is_file():
        from minfer.checkpoints import write_random_checkpoint

        # Write next to it, then rename: a run that stops half-way leaves no broken checkpoint.
        partial = TINY_DIR.with_name(f"{TINY_DIR.name}.{os.getpid()}")
        write_random_checkpoint(partial, "tiny")
        try:
            partial.rename(TINY_DIR)
        except OSError:  # another run got there first; theirs is as good as ours
            shutil.rmtree(partial, ignore_errors=True)
    print(f"model: tiny random checkpoint at {TINY_DIR} (gpt2 not available; set MINFER_MODEL to choose)")
    return str(TINY_DIR)


def section(title: str) -> None:
    """Print a heading, so a script's output reads as the chapter does."""
    print(f"\n== {title} ==")
