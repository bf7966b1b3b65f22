"""`python -m minfer ...`: the `minfer` command (cli.py)."""

import sys

from .cli import main

sys.exit(main())
