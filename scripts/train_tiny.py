"""`python scripts/train_tiny.py OUT_DIR ...`: train minfer-tiny, a small GPT-2, from scratch on a CPU.
The code lives in minfer/training/train_tiny.py (read it: it is short); `minfer train-tiny ...` runs the same.

    python scripts/train_tiny.py minfer/models/builtin/minfer-tiny        # with retellings (~30 min, 2 cores)
    python scripts/train_tiny.py minfer/models/builtin/minfer-tiny --retell 0   # the shipped weights
    python scripts/train_tiny.py /tmp/draft --n-layer 2 --n-embd 64 --tokenizer minfer/models/builtin/minfer-tiny
"""

import sys

from minfer.training.train_tiny import main

if __name__ == "__main__":
    sys.exit(main())
