"""Generate text from the command line, streaming it as it is produced.

python -m minfer.generate "The meaning of life is" --max-tokens 40
python -m minfer.generate --model ./my-checkpoint --temperature 0 "Hello"
"""

from __future__ import annotations

import argparse
import sys

from .engine.llm import DTYPES, LLM
from .engine.sampling import SamplingParams


def main(argv: list[str] | None = None, prog: str = "python -m minfer.generate") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument("--model", default="gpt2", help="local checkpoint directory or Hub repo id")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES) + ["auto"], default="float32")
    args = parser.parse_args(argv)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            seed=args.seed,
        )
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_num_seqs=1)
        request_id = llm.scheduler.add_request(args.prompt, sampling_params=params)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    # One request through the same engine the server uses: step, print the new text.
    scheduler = llm.scheduler
    sys.stdout.write(args.prompt)
    for _ in scheduler.steps():
        sys.stdout.write(scheduler.get_new_text(request_id))
        sys.stdout.flush()
    sys.stdout.write(scheduler.get_new_text(request_id) + "\n")
    scheduler.pop_response(request_id)
    return 0


if __name__ == "__main__":
    sys.exit(main())
