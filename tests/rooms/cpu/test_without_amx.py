"""scripts/without_amx.py runs a command as a CPU with AVX512-BF16 and no AMX would: every probe says no AMX."""

import subprocess
import sys
from pathlib import Path

import pytest

from minfer.cpu.features import cpu_flags

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import os, sys, torch
import minfer.compiled.cache_key as cache_key
from minfer.cpu.features import cpu_has_amx, cpu_has_native_bf16
print(sys.argv[1:], os.environ["ONEDNN_MAX_CPU_ISA"], torch.cpu._is_amx_tile_supported(), cpu_has_amx(),
      any(f.startswith("amx") for f in cache_key.cpu_flags()), cpu_has_native_bf16())
"""


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="the script keeps AVX512-BF16: this CPU has none")
def test_a_command_run_without_amx_sees_none(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "without_amx.py"), str(script), "--flag"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['--flag']", "AVX512_CORE_BF16", "False", "False", "False", "True"]
