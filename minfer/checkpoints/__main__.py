"""python -m minfer.checkpoints OUT_DIR [--config ...] [--layout ...] [--seed N] [--tools]: a random checkpoint."""

from __future__ import annotations

import argparse
import sys

from . import LAYOUTS, LLAMA_CONFIGS, PRESETS, write_random_checkpoint
from .files import is_random_checkpoint, why_not_write_into


def main(argv: list[str] | None = None, prog: str = "python -m minfer.random_model") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Write a GPT-2, Qwen3 or Llama checkpoint with random weights (for tests and offline use).",
    )
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--config", choices=PRESETS, default="tiny", help="model shape")
    parser.add_argument("--layout", choices=LAYOUTS, default="hub", help="tensor-name layout")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights and tokenizer")
    parser.add_argument("--tools", action="store_true", help="Qwen3 and Llama: a chat template that renders tools")
    parser.add_argument("--force", action="store_true", help="write into a directory that holds other files")
    args = parser.parse_args(argv)
    if not 0 <= args.seed < 2**64:  # torch's generator overflows past it
        parser.error(f"--seed must be an integer in [0, 2**64), as the engine's, got {args.seed}")
    if args.tools and args.config not in LLAMA_CONFIGS:
        parser.error("--tools needs a chat model: --config " + " or ".join(LLAMA_CONFIGS))
    refusal = why_not_write_into(args.out_dir, is_random_checkpoint, "random checkpoint", args.force)
    if refusal is not None:
        parser.error(refusal)
    extra = {"tools": True} if args.tools else {}
    try:
        out = write_random_checkpoint(args.out_dir, args.config, args.layout, args.seed, **extra)
    except OSError as e:
        print(f"{prog}: error: cannot write {args.out_dir}: {e.strerror or e}", file=sys.stderr)
        return 1
    layout = "" if args.config in LLAMA_CONFIGS else f" ({args.layout} layout)"
    print(f"wrote a random {args.config} checkpoint{layout} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
