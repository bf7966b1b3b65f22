"""Writing checkpoint files the way a user expects to find them."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

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


def why_not_write_into(out_dir: str, is_ours: Callable[[Path], bool], what: str, force: bool) -> str | None:
    """Why a command must not write its checkpoint into out_dir, or None. A directory that is not empty must
    hold `what` written before (`is_ours`), unless forced: anything else may be someone's model, or their files."""
    if not out_dir:
        return "the output directory is empty: name the directory to write"
    if force:
        return None
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        return f"{out} exists and is not a directory"
    if not out.is_dir() or not any(out.iterdir()) or is_ours(out):
        return None
    return f"{out} is not empty and holds no {what} of minfer's: pass --force to write into it anyway"


def config_of(checkpoint: Path) -> dict:
    """The checkpoint's config.json, or {} where there is none to read."""
    try:
        config = json.loads((checkpoint / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return config if isinstance(config, dict) else {}


def is_random_checkpoint(checkpoint: Path) -> bool:
    return RANDOM_MARK in config_of(checkpoint)
