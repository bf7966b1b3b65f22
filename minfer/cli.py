"""The `minfer` command: one entry point for what minfer's modules run, as `vllm serve` is vLLM's.

    minfer serve --model gpt2 --port 8000     (= python -m minfer.serve ...)
    minfer generate "Hello" --max-tokens 20   (= python -m minfer.generate ...)
    minfer random-model /tmp/tiny             (= python -m minfer.random_model ...)
    minfer stress --duration 60               (= python -m minfer.stress ...)
    minfer bench --num-requests 64            (= python bench.py ...)
    minfer eval-ppl --model minfer-tiny FILE  (perplexity of a checkpoint on a text file)
    minfer quantize SRC DST --quantization int8  (a quantized checkpoint: python -m minfer.quantize)
    minfer train-tiny OUT_DIR                 (= python scripts/train_tiny.py ...: train minfer-tiny)
    minfer settings                           (the environment variables minfer reads, as set here)

Each subcommand takes the same flags as the module it names; `minfer SUBCOMMAND --help` lists them.
Subcommands import their module only when chosen, so `minfer --help` is instant.
"""

from __future__ import annotations

import importlib
import sys

# name -> (module whose main() runs it, one line of help)
SUBCOMMANDS = {
    "serve": ("minfer.server.serve", "run the OpenAI-compatible HTTP server"),
    "generate": ("minfer.generate", "generate text from the command line, streaming it"),
    "random-model": ("minfer.checkpoints.__main__", "write a checkpoint with random weights (offline)"),
    "stress": ("minfer.stress.__main__", "soak a server with misbehaving and well-behaved clients"),
    "bench": ("minfer.bench.cli", "benchmark TTFT, TPOT, ITL and throughput, offline or online"),
    "eval-ppl": ("minfer.bench.perplexity", "perplexity of a checkpoint on a text file (quality yardstick)"),
    "quantize": ("minfer.quantize", "write an int8/int4 weight-only quantized checkpoint"),
    "settings": ("minfer.settings.__main__", "the environment variables minfer reads, and their values here"),
    "train-tiny": (
        "minfer.training.train_tiny",
        "train a small GPT-2 (or Llama) on simple stories, on a CPU (minfer-tiny)",
    ),
}


def usage() -> str:
    width = max(map(len, SUBCOMMANDS))
    lines = [f"  {name:<{width}}  {help}" for name, (_, help) in SUBCOMMANDS.items()]
    return "usage: minfer SUBCOMMAND [ARGS...]\n\nsubcommands:\n" + "\n".join(lines) + (
        "\n\n`minfer SUBCOMMAND --help` shows a subcommand's flags."
    )


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"minfer: unknown subcommand {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUBCOMMANDS[name][0])
    return module.main(rest, prog=f"minfer {name}") or 0


if __name__ == "__main__":
    sys.exit(main())
