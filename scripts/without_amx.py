"""Run a minfer command as a CPU with AVX512-BF16 and no AMX (Zen 4, Zen 5) would, on a host that has AMX.

    python scripts/without_amx.py bench.py --model DIR --dtype auto ...      # a script, with its arguments
    python scripts/without_amx.py -m minfer.serve --model DIR --port 8000    # or a module

AMX is taken from oneDNN (ONEDNN_MAX_CPU_ISA, read when torch loads it), from torch and Inductor (their probe
says no, so Inductor's GEMM templates take AVX-512 micro-kernels) and from minfer's CPU flags (which choose
its paths and key its compile cache), then the command runs in this process. The memory and the cores stay
the host's: a measure of which path wins, not of a Zen's speed (docs/performance.md, "AVX512-BF16 without AMX").
"""

import os
import runpy
import sys

os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch.cpu  # noqa: E402

import minfer.cpu.features as features  # noqa: E402

torch.cpu._is_amx_tile_supported = lambda: False
torch.cpu._is_amx_fp16_supported = lambda: False
_host_flags = features.cpu_flags
_flags = frozenset(flag for flag in _host_flags() if not flag.startswith("amx"))
for module in [m for name, m in sys.modules.items() if name.startswith("minfer")]:
    if getattr(module, "cpu_flags", None) is _host_flags:  # cpu_has_amx() and the compile cache's key read them
        module.cpu_flags = lambda: _flags


def main() -> None:
    if "avx512_bf16" not in _flags:
        sys.exit("without_amx.py: this CPU has no AVX512-BF16 to keep")
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    if sys.argv[1] == "-m":
        module, sys.argv = sys.argv[2], sys.argv[2:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
