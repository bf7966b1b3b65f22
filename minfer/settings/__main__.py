"""python -m minfer.settings (`minfer settings`): every environment variable minfer reads, with its value here.

A module of its own: run as __main__, the package's settings module would be a second copy of the one the
package already imported (runpy warns of it)."""

from __future__ import annotations

import argparse
import sys

from . import ALL


def main(argv: list[str] | None = None, prog: str = "python -m minfer.settings") -> int:
    argparse.ArgumentParser(prog=prog, description="Every environment variable minfer reads: its value here, and "
                            "what it does.").parse_args(argv)
    width = max(len(var.name) + 1 + len(var.get("")) for var in ALL)
    for var in ALL:
        print(f"{var.name + '=' + var.get(''):<{width}}  {var.help}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
