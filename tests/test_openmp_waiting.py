"""minfer shortens libgomp's spin-wait before torch loads (a busy neighbour process otherwise makes
every parallel region wait on a descheduled thread), unless the user chose, or torch came first."""

import os
import subprocess
import sys

import pytest

from minfer.openmp_waiting import SPIN_COUNT

PROBE = "import os, minfer.openmp_waiting as w; print(os.environ.get('GOMP_SPINCOUNT'), '|', w.wait_policy())"


def probe(env_extra: dict, first: str = "") -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = f"{first}import minfer; {PROBE}"
    out = subprocess.run([sys.executable, "-c", code], env={**env, **env_extra}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()  # fmt: skip
    spin, _, policy = out.partition(" | ")
    return spin, policy


def test_minfer_sets_a_short_spin_before_torch_loads():
    spin, policy = probe({})
    assert spin == SPIN_COUNT and "minfer's" in policy


@pytest.mark.parametrize("name, value", [("GOMP_SPINCOUNT", "5"), ("OMP_WAIT_POLICY", "PASSIVE")])
def test_the_users_choice_wins(name, value):
    spin, policy = probe({name: value})
    assert spin == (value if name == "GOMP_SPINCOUNT" else "None")
    assert f"{name}={value} (from the environment)" in policy


def test_too_late_after_torch_and_says_so():
    spin, policy = probe({}, first="import torch; ")
    assert spin == "None" and "torch was imported before minfer" in policy
