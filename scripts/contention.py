"""How minfer behaves when another process competes for the CPU: the same offline bench run
alone, then beside busy processes (`python -c "while True: pass"`, one per --busy), alternating.

    python scripts/contention.py --model /tmp/gpt2-random [--rounds 3] [--busy 1] [-- extra bench flags]

Prints each run's output throughput and the median ratio busy / alone. Environment variables
and flags after `--` go to every bench run, so a variant (e.g. GOMP_SPINCOUNT=0, --num-threads 1)
is measured the same way.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = ["--num-requests", "32", "--input-len", "64", "--output-len", "64", "--disable-tqdm"]


def bench(model: str, extra: list[str]) -> float:
    """Output tokens per second of one offline run."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, str(ROOT / "bench.py"), "--model", model, *WORKLOAD, "--json", str(out), *extra]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return json.loads(out.read_text())["summary"]["output_throughput"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (e.g. a random GPT-2)")
    parser.add_argument("--rounds", type=int, default=3, help="alternating alone/busy pairs")
    parser.add_argument("--busy", type=int, default=1, help="competing busy processes")
    parser.add_argument("extra", nargs="*", help="flags for bench.py (after --)")
    args = parser.parse_args()
    alone, busy = [], []
    for _ in range(args.rounds):
        alone.append(bench(args.model, args.extra))
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            busy.append(bench(args.model, args.extra))
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        print(f"alone {alone[-1]:7.1f} tok/s   with {args.busy} busy process(es) {busy[-1]:7.1f} tok/s", flush=True)
    ratio = statistics.median(b / a for a, b in zip(alone, busy))
    print(f"median alone {statistics.median(alone):.1f} tok/s, busy {statistics.median(busy):.1f} tok/s: "
          f"{ratio:.2f}x ({os.cpu_count()} cores; extra flags: {' '.join(args.extra) or 'none'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
