"""`python -m minfer.random_model OUT_DIR ...`, kept for scripts that use it: see minfer/checkpoints/."""

import sys

from .checkpoints import write_random_checkpoint  # noqa: F401  (the name older code imports from here)
from .checkpoints.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
