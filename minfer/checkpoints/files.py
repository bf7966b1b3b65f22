"""Writing checkpoint files the way a user expects to find them."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, then the file mode every other file gets (0644 under the usual umask):
    save_file creates it 0600, so a checkpoint written by one user would be unreadable to the next."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
