"""Shared fixtures: random GPT-2 checkpoints written once per test session (the Hub is offline)."""

import json

import pytest
import torch

from minfer.checkpoints import write_random_checkpoint

torch.set_num_threads(2)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """make_checkpoint(preset="tiny", layout="hub", seed=0, **overrides) -> Path, cached per arguments."""
    cache = {}

    def make(preset="tiny", layout="hub", seed=0, **overrides):
        key = (preset, layout, seed, json.dumps(overrides, sort_keys=True))  # overrides may hold dicts
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ckpt-{preset}-{layout}")
            cache[key] = write_random_checkpoint(out, preset, layout, seed, **overrides)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint):
    """The default test model: 2 layers, 4 heads, 64 channels, vocab 512, context 512."""
    return make_checkpoint()
