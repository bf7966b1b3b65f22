"""`python -m minfer.random_model OUT_DIR [--config ...]`: write a checkpoint with random weights, as
`minfer random-model` does; the writers are in minfer/checkpoints/."""

import sys

from .checkpoints import write_random_checkpoint  # noqa: F401  (importable from here too)
from .checkpoints.__main__ import main

if __name__ == "__main__":
    sys.exit(main())
