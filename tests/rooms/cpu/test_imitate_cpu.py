"""scripts/imitate_cpu.py runs a command as a smaller CPU kind would: every probe and flag says what that kind has."""

import subprocess
import sys
from pathlib import Path

import pytest

from minfer.cpu.features import cpu_flags

ROOT = Path(__file__).resolve().parents[3]

PROBE = """
import sys, torch
import minfer.compiled.cache_key as cache_key
from minfer.cpu.features import cpu_has_amx, cpu_has_native_bf16
from minfer.quantization.int8 import HAS_INT8_DOT, Int8Linear
print(sys.argv[1:], torch.backends.cpu.get_cpu_capability(), torch.cpu._is_amx_tile_supported(),
      torch.cpu._is_avx512_supported(), cpu_has_amx(), cpu_has_native_bf16(),
      sorted({f[:6] for f in cache_key.cpu_flags() if f.startswith(("amx", "avx512"))}),
      HAS_INT8_DOT, Int8Linear.rounds_batches)
"""


def imitated(kind: str, tmp_path) -> list[str]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "imitate_cpu.py"), kind, str(script), "--flag"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().split(maxsplit=6)


@pytest.mark.skipif("avx512_bf16" not in cpu_flags(), reason="an AVX512-BF16 CPU imitates one without AMX")
def test_avx512_bf16_without_amx(tmp_path):
    flag, capability, amx_probe, avx512_probe, amx, bf16, rest = imitated("avx512-bf16", tmp_path)
    assert (flag, amx_probe, avx512_probe, amx, bf16) == ("['--flag']", "False", "True", "False", "True")
    assert capability.startswith("AVX512") and rest == "['avx512'] True True"  # VNNI kept


@pytest.mark.skipif("avx2" not in cpu_flags(), reason="an AVX2 CPU imitates one with AVX2 alone")
def test_avx2_alone(tmp_path):
    flag, capability, amx_probe, avx512_probe, amx, bf16, rest = imitated("avx2", tmp_path)
    assert (flag, capability, amx_probe, avx512_probe, amx, bf16) == (
        "['--flag']", "AVX2", "False", "False", "False", "False")
    assert rest == "[] False False"  # no int8 dot products: batches are not rounded to int8
