"""minfer leaves libgomp's spin-wait as it is (CpuShare handles a busy neighbour by dropping a thread,
cpu_share.py), and reports how OpenMP threads wait: the user's choice when there is one."""

import os
import subprocess
import sys

import pytest

PROBE = "import os, minfer.cpu.openmp as w; print(os.environ.get('GOMP_SPINCOUNT'), '|', w.wait_policy())"


def probe(env_extra: dict) -> tuple[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    code = f"import minfer; {PROBE}"
    out = subprocess.run([sys.executable, "-c", code], env={**env, **env_extra}, capture_output=True, text=True,
                         timeout=120, check=True).stdout.strip()  # fmt: skip
    spin, _, policy = out.partition(" | ")
    return spin, policy


def test_minfer_leaves_the_spin_alone():
    spin, policy = probe({})
    assert spin == "None" and "libgomp's default spin" in policy


@pytest.mark.parametrize("name, value", [("GOMP_SPINCOUNT", "5"), ("OMP_WAIT_POLICY", "PASSIVE")])
def test_the_users_choice_is_reported(name, value):
    spin, policy = probe({name: value})
    assert spin == (value if name == "GOMP_SPINCOUNT" else "None")
    assert f"{name}={value} (from the environment)" in policy
