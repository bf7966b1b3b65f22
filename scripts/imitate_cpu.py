"""Run a minfer command as a smaller CPU would, on a host that has more: which path wins there, not its speed.

    python scripts/imitate_cpu.py avx512-bf16 bench.py --model DIR ...    # AVX512-BF16, no AMX (Zen 4, Zen 5)
    python scripts/imitate_cpu.py avx2 -m minfer.serve --model DIR ...    # AVX2 only (Zen 3)

What the kind lacks is taken from oneDNN and MKL (their ISA caps, read when torch loads them), from torch's
kernels (ATEN_CPU_CAPABILITY) and its probes, which Inductor reads to pick its vector ISA and GEMM micro-kernels,
and from minfer's CPU flags (they choose its paths and key its compile cache); then the command runs in this
process. The memory and the cores stay the host's (docs/performance.md, "AVX512-BF16 without AMX").
"""

import os
import runpy
import sys

KINDS = {  # kind -> (environment, torch probes that say no, flag prefixes hidden from minfer)
    "avx512-bf16": ({"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
                    ("_is_amx_tile_supported", "_is_amx_fp16_supported"), ("amx",)),
    "avx2": ({"ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ATEN_CPU_CAPABILITY": "avx2"},
             ("_is_amx_tile_supported", "_is_amx_fp16_supported", "_is_avx512_supported",
              "_is_avx512_bf16_supported", "_is_vnni_supported"), ("amx", "avx512", "avx_vnni")),
}


def imitate(kind: str) -> None:
    """Before torch and minfer load: the environment; after: their probes and flags."""
    environment, probes, hidden = KINDS[kind]
    os.environ.update(environment)
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import torch.cpu

    import minfer.cpu.features as features
    import minfer.quantization.int8 as int8
    import minfer.quantization.transform as transform

    for probe in probes:
        setattr(torch.cpu, probe, lambda: False)
    host_flags = features.cpu_flags
    flags = frozenset(flag for flag in host_flags() if not flag.startswith(hidden))
    if kind == "avx512-bf16" and "avx512_bf16" not in flags:
        sys.exit("imitate_cpu.py: this CPU has no AVX512-BF16 to keep")
    for module in [m for name, m in sys.modules.items() if name.startswith("minfer")]:
        if getattr(module, "cpu_flags", None) is host_flags:  # cpu_has_amx() and the compile cache's key read them
            module.cpu_flags = lambda: flags
    # int8 chose its batch path when minfer was imported: as the kind's int8 dot products say
    int8.HAS_INT8_DOT = transform.HAS_INT8_DOT = int8.Int8Linear.rounds_batches = features.cpu_has_int8_dot()


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] not in KINDS:
        sys.exit(__doc__)
    imitate(sys.argv[1])
    if sys.argv[2] == "-m":
        module, sys.argv = sys.argv[3], sys.argv[3:]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    else:
        sys.argv = sys.argv[2:]
        runpy.run_path(sys.argv[0], run_name="__main__")


if __name__ == "__main__":
    main()
