"""How minfer behaves when another process competes for the CPU: the same offline bench run
alone, then beside busy processes (`python -c "while True: pass"`, one per --busy), alternating.

    python scripts/contention.py --model /tmp/gpt2-random [--rounds 3] [--busy 1] [-- extra bench flags]

Prints each run's output throughput and the median ratio busy / alone. Environment variables
and flags after `--` go to every bench run, so a variant (e.g. GOMP_SPINCOUNT=0, --num-threads 1)
is measured the same way. With `-- --baseline hf`, transformers runs the same workload in each run
too, and its figures and minfer's ratio to it are printed beside.
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


def bench(model: str, extra: list[str]) -> tuple[float, float | None]:
    """Output tokens per second of one offline run: minfer's, and transformers' if it ran too."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run.json"
        cmd = [sys.executable, str(ROOT / "bench.py"), "--model", model, *WORKLOAD, "--json", str(out), *extra]
        run = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if run.returncode != 0:  # its last line says why (bench.py's errors are one line)
            why = (run.stderr.strip().splitlines() or ["no message"])[-1]
            raise SystemExit(f"contention.py: bench.py exited with {run.returncode}: {why}")
        report = json.loads(out.read_text())
        baseline = report.get("baseline", {}).get("summary", {}).get("output_throughput")
        return report["summary"]["output_throughput"], baseline


def at_least_one(text: str) -> int:
    try:
        number = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a whole number, got {text!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {number}")
    return number


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="checkpoint directory (e.g. a random GPT-2)")
    parser.add_argument("--rounds", type=at_least_one, default=3, help="alternating alone/busy pairs")
    parser.add_argument("--busy", type=at_least_one, default=1, help="competing busy processes")
    parser.add_argument("extra", nargs="*", help="flags for bench.py (after --)")
    args = parser.parse_args()
    alone, busy = [], []  # (minfer tok/s, transformers tok/s or None) per run
    for _ in range(args.rounds):
        alone.append(bench(args.model, args.extra))
        hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            busy.append(bench(args.model, args.extra))
        finally:
            for h in hogs:
                h.kill()
                h.wait()
        line = f"alone {alone[-1][0]:7.1f} tok/s   with {args.busy} busy process(es) {busy[-1][0]:7.1f} tok/s"
        if alone[-1][1] and busy[-1][1]:
            line += f"   (transformers: alone {alone[-1][1]:.1f}, busy {busy[-1][1]:.1f})"
        print(line, flush=True)
    ratio = statistics.median(b[0] / a[0] for a, b in zip(alone, busy))
    print(f"median alone {statistics.median(a[0] for a in alone):.1f} tok/s, busy "
          f"{statistics.median(b[0] for b in busy):.1f} tok/s: {ratio:.2f}x "
          f"({os.cpu_count()} cores; extra flags: {' '.join(args.extra) or 'none'})")
    if all(a[1] and b[1] for a, b in zip(alone, busy)):
        quiet = statistics.median(a[0] / a[1] for a in alone)
        loaded = statistics.median(b[0] / b[1] for b in busy)
        print(f"minfer / transformers: {quiet:.2f}x alone, {loaded:.2f}x beside the busy process(es)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
