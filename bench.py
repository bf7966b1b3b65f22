"""`python bench.py ...`: minfer's benchmark (TTFT, TPOT, ITL, throughput). The code lives in
minfer/bench/cli.py; `minfer bench ...` runs the same."""

import sys

from minfer.bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
