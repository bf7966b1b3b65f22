"""Generate text from the command line, streaming it as it is produced.

    python -m minfer.generate "The meaning of life is" --max-tokens 40
    python -m minfer.generate --model ./my-checkpoint --temperature 0 "Hello"
"""

from __future__ import annotations

import argparse
import sys

import torch

from .model import GPT2
from .sampling import SamplingParams, make_generator, sample
from .tokenizer import Tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@torch.inference_mode()
def stream_tokens(model: GPT2, prompt_ids: list[int], params: SamplingParams, eos_token_id: int | None):
    """The plainest generation loop: rerun the whole sequence each step (no KV cache yet)."""
    ids = torch.tensor([prompt_ids], device=model.device)  # (1, T)
    generator = make_generator(params.seed, model.device)
    stop_ids = set(params.stop_token_ids or [])
    if eos_token_id is not None and not params.ignore_eos:
        stop_ids.add(eos_token_id)
    for _ in range(params.max_tokens):
        if ids.shape[1] >= model.config.n_positions:
            break
        logits = model(ids)[:, -1]  # (1, V): only the last position predicts the next token
        token = sample(logits, [params], [generator])  # (1,)
        token_id = int(token)
        if token_id in stop_ids:
            break
        yield token_id
        ids = torch.cat([ids, token[:, None]], dim=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m minfer.generate", description=__doc__.splitlines()[0])
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument("--model", default="gpt2", help="local checkpoint directory or Hub repo id")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    args = parser.parse_args(argv)
    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed,
        )  # fmt: skip
        model = GPT2.from_pretrained(args.model, device=args.device, dtype=DTYPES[args.dtype])
        tokenizer = Tokenizer.from_dir(model.model_dir)
        prompt_ids = tokenizer.encode(args.prompt)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    detok = tokenizer.detokenizer()
    sys.stdout.write(args.prompt)
    for token_id in stream_tokens(model, prompt_ids, params, tokenizer.eos_token_id):
        sys.stdout.write(detok.add(token_id))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
