"""What structured outputs' token masks cost per token, without a model: llguidance's fill and the apply.

    python scripts/mask_cost.py [--model DIR] [--streams 16] [--steps 200] [--vocab N]

Takes the tokenizer of --model (default: a GPT-2-sized one trained here, 50,257 tokens, the 124M shape's),
compiles bench.py's --structured-output json-schema grammar, and walks `--streams` sequences through it
together, each step drawing a random allowed token per sequence. Each step is timed the way the engine
runs it: the fill of every sequence's mask (llguidance, in parallel over the sequences, no GIL) and the
apply to (streams, vocab) fp32 logits on the CPU. Prints microseconds per masked row (= per token).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from minfer.bench.workload import STRUCTURED_OUTPUTS  # noqa: E402
from minfer.checkpoints import train_tokenizer  # noqa: E402
from minfer.engine.structured_outputs_params import StructuredOutputsParams  # noqa: E402
from minfer.structured.grammars import Grammars, import_llguidance  # noqa: E402
from minfer.structured.masks import bias_table, expand, unpack  # noqa: E402
from minfer.text.tokenizer import Tokenizer  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint directory whose tokenizer to use")
    parser.add_argument("--vocab", type=int, help="the logits' width (default: the tokenizer's)")
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    if args.model:
        tokenizer = Tokenizer.from_dir(args.model)
    else:
        print("training a 50,257-token tokenizer (the GPT-2 124M shape's) ...", file=sys.stderr)
        tokenizer = Tokenizer(train_tokenizer(50257, 0), eos_token_id=50256)
    vocab = args.vocab or tokenizer.vocab_size
    llg = import_llguidance()
    grammars = Grammars(tokenizer, vocab)
    spec = StructuredOutputsParams(**STRUCTURED_OUTPUTS["json-schema"])
    matchers = [grammars.matcher(spec) for _ in range(args.streams)]
    executor = llg.LLExecutor()
    words = (vocab + 31) // 32
    bits = torch.empty(args.streams, words, dtype=torch.int32)
    table = bias_table(torch.float32, torch.device("cpu"))
    logits = torch.randn(args.streams, vocab)
    rng = random.Random(0)
    fill = apply = 0.0
    for step in range(args.steps + 10):
        start = time.perf_counter()
        executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(matchers)], bits.data_ptr(), 4 * words,
                                         args.streams)
        filled = time.perf_counter()
        logits.add_(expand(bits, vocab, table))  # as StepMasks.apply does
        applied = time.perf_counter()
        if step >= 10:  # after a warm-up: the first masks build llguidance's caches
            fill, apply = fill + filled - start, apply + applied - filled
        for m, row in zip(matchers, unpack(bits, vocab)):
            m.consume_token(rng.choice(row.nonzero().flatten().tolist()))
        logits.normal_()
    rows = args.steps * args.streams
    print(f"{args.streams} streams, vocab {vocab}, {torch.get_num_threads()} torch threads, {args.steps} steps:")
    print(f"  fill  {1e6 * fill / rows:7.1f} us per masked row ({1e3 * fill / args.steps:.2f} ms per step)")
    print(f"  apply {1e6 * apply / rows:7.1f} us per masked row ({1e3 * apply / args.steps:.2f} ms per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
