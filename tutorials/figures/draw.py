"""Draw the tutorials' figures from the engine's real state, on minfer-tiny (it ships with minfer).

    python tutorials/figures/draw.py              # redraw every figure here, in tutorials/figures/
    python tutorials/figures/draw.py --out /tmp/f 07 10   # some of them, elsewhere

Each figure runs minfer's own code (the allocator, the attention backend, the scheduler, the manager,
the server) and draws what it read back. The first five come out the same on every run, so the tests
redraw them and compare; the thread and HTTP figures time and order a real run, so they are redrawn
and checked to draw, not compared.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # svg.py, blocks.py, flow.py

import blocks  # noqa: E402
import flow  # noqa: E402

# stage -> (file name, drawing function, whether the same state draws the same file on every run)
FIGURES = {
    "07": ("07_block_tables.svg", blocks.block_tables, True),
    "08": ("08_paged_read.svg", blocks.paged_read, True),
    "09": ("09_shared_prefix.svg", blocks.shared_prefix, True),
    "10": ("10_step_timeline.svg", flow.step_timeline, True),
    "11": ("11_thread_flow.svg", flow.thread_flow, False),
    "12": ("12_http_path.svg", flow.http_path, False),
    "16": ("16_copy_on_write.svg", blocks.copy_on_write, True),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stages", nargs="*", help=f"which figures (default: all of {', '.join(FIGURES)})")
    parser.add_argument("--out", type=Path, default=HERE, help="the folder to write them to")
    args = parser.parse_args(argv)
    unknown = [s for s in args.stages if s not in FIGURES]
    if unknown:
        parser.error(f"no figure for stage {', '.join(unknown)}; there are {', '.join(FIGURES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for stage in args.stages or FIGURES:
        name, draw, _ = FIGURES[stage]
        draw(args.out / name)
        print(f"drew {args.out / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
