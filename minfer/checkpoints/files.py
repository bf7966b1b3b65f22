"""Writing checkpoint files the way a user expects to find them."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file


RANDOM_MARK = "minfer_random_checkpoint"  # config.json's key that says random-model wrote it: {preset, seed}


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, then the file mode every other file gets (0644 under the usual umask):
    save_file creates it 0600, so a checkpoint written by one user would be unreadable to the next."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def why_not_write_into(out_dir: str) -> str | None:
    """Why random-model must not write its files into `out` unasked, or None. A directory that is not empty
    must hold a random checkpoint written before: anything else may be someone's model, or their files."""
    if not out_dir:
        return "OUT_DIR is empty: name the directory to write"
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a directory"
    if not out.is_dir() or not any(out.iterdir()):
        return None
    try:
        if RANDOM_MARK in json.loads((out / "config.json").read_text()):
            return None
    except (OSError, ValueError, TypeError):  # no config.json, or not one of ours: not a random checkpoint either way
        pass
    return f"{out} is not empty and holds no random checkpoint of minfer's: pass --force to write into it anyway"
