"""minfer eval-ppl: the perplexity of a checkpoint on a text file, a yardstick for quality.

    minfer eval-ppl --model minfer-tiny minfer/models/builtin/minfer-tiny/heldout.txt
    python -m minfer.bench.perplexity --model DIR --dtype bfloat16 FILE
    minfer eval-ppl --model minfer-tiny --dtype auto --quantization int4 --quantization-group-size 32 FILE

The model is the one minfer serves (load_model, the dtype and threads the engine would use), run
through its plain forward: the engine's step computes logits only for rows that sample, and
perplexity needs every position's. The file is tokenized whole, as one stream and as a prompt is
(special tokens written in it, such as <|endoftext|>, are one id each; a tokenizer that adds a BOS,
as Llama's do, adds it ahead, so the text's first token is scored after it), and scored in sliding
windows of the model's context with a stride of half of it: every token but the first is scored once,
with at least half a context before it once the text is that long.

The method (Hugging Face's "perplexity of fixed-length models"): windows of `window` tokens start
every `stride` tokens, and each window scores only the tokens no earlier window scored.
Perplexity is exp(total negative log-likelihood / tokens scored). train-tiny scores its models
with the same functions, so a model card's figure is what eval-ppl prints.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
import torch.nn.functional as F

from ..engine.config import CPU_OR_CUDA, DTYPES, is_cpu_or_cuda
from ..errors import BadSetting, whole_number
from ..assembly.build import check_device, resolve_dtype, set_cpu_threads
from ..models.registry import load_model
from ..quantization import GROUP_SIZES, QUANTIZATION_METHODS, check_quantization, quantize_model
from ..quantization.checkpoint import QuantizationSpec, QuantizedWeights
from ..text.tokenizer import Tokenizer
from .workload import utf8_text


@dataclass(frozen=True)
class Perplexity:
    nll: float  # summed negative log-likelihood, in nats
    tokens: int  # tokens scored: every token but the first

    @property
    def loss(self) -> float:
        """Mean negative log-likelihood per token (nats): the training loss."""
        return self.nll / self.tokens

    @property
    def perplexity(self) -> float:
        return math.exp(self.loss)


def windows(num_tokens: int, window: int, stride: int) -> Iterator[tuple[int, int, int]]:
    """(begin, end, first) per window: it runs on tokens [begin, end) and scores tokens [first, end)."""
    if not 0 < stride < window:  # windows must overlap: a window's first token has nothing before it
        raise ValueError(f"stride must be in [1, window - 1 = {window - 1}], got {stride}")
    scored = 1  # token 0 has nothing before it to predict it
    for begin in range(0, max(num_tokens - 1, 1), stride):
        end = min(begin + window, num_tokens)
        if end > scored:
            yield begin, end, scored
            scored = end
        if end == num_tokens:
            break


@torch.inference_mode()
def perplexity(
    forward: Callable[[torch.Tensor], torch.Tensor], token_ids: list[int] | torch.Tensor, window: int, stride: int
) -> Perplexity:
    """Score `token_ids` with `forward`: (1, T) ids -> (1, T, vocab) logits (minfer's plain model forward)."""
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.numel() < 2:
        raise ValueError("perplexity needs at least 2 tokens")
    nll, count = 0.0, 0
    for begin, end, first in windows(ids.numel(), window, stride):
        logits = forward(ids[None, begin:end])[0]  # (T, V)
        predicted_by = logits[first - 1 - begin : end - 1 - begin].float()  # the logits at t-1 predict token t
        targets = ids[first:end].to(logits.device)
        nll += F.cross_entropy(predicted_by, targets, reduction="sum").item()  # summed in Python's float64
        count += targets.numel()
    return Perplexity(nll, count)


def file_perplexity(
    model_name: str, path: str | Path, dtype: str | torch.dtype = "float32", device: str = "cpu",
    window: int | None = None, stride: int | None = None, quantization: str | None = None,
    group_size: int | None = None, quantize_lm_head: bool = True, quantize_activations: bool = False,
) -> tuple[Perplexity, int, int]:
    """(the result, window, stride) for the text file at `path` under checkpoint `model_name`,
    quantized as the engine's --quantization would (quantization/) if one is given."""
    text = utf8_text(Path(path), str(path))
    check_quantization(quantization, group_size, quantize_lm_head, quantize_activations)
    spec = None if quantization is None else QuantizationSpec(quantization, group_size, quantize_lm_head)
    model = load_model(model_name, device=device, dtype=resolve_dtype(dtype, torch.device(device)),
                       weights=QuantizedWeights(spec))
    if quantize_activations:  # the weights are quantized already: this sets how int8 linears multiply
        quantize_model(model, quantization, group_size, quantize_lm_head, quantize_activations=True)
    ids = Tokenizer.from_dir(model.model_dir).encode_prompt(text)  # with its BOS, as HF's method has it
    window = model.config.max_positions if window is None else window
    stride = max(1, window // 2) if stride is None else stride
    if window < 2:  # a window's first token has nothing before it: one more is the least that scores anything
        raise BadSetting(f"--window must be >= 2 tokens, got {window}")
    if window > model.config.max_positions:
        raise BadSetting(f"--window {window} exceeds the model's context of {model.config.max_positions}")
    if stride >= window:  # the window the model's context sets: main() checks one given before loading
        raise BadSetting(f"--stride must be below --window ({window}): windows overlap, got {stride}")
    result = perplexity(lambda x: model(x.to(model.device)), ids, window, stride)
    return result, window, stride


def positive_int(text: str) -> int:
    number = whole_number(text)
    if not number:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}")
    return number


def main(argv: list[str] | None = None, prog: str = "python -m minfer.bench.perplexity") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                     epilog="Method: sliding windows of the model's context, stride half of it; "
                                     "every token but the first is scored once. Perplexity = exp(mean NLL).")
    parser.add_argument("file", help="a UTF-8 text file")
    parser.add_argument("--model", default="minfer-tiny", help="checkpoint directory, built-in name or Hub id")
    parser.add_argument("--dtype", choices=sorted(DTYPES) + ["auto"], default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--window", type=positive_int, help="tokens per window (default: the model's context)")
    parser.add_argument("--stride", type=positive_int, help="tokens between window starts (default: half the window)")
    parser.add_argument("--quantization", choices=QUANTIZATION_METHODS, help="weight-only int8 or int4 (default: none)")
    parser.add_argument("--quantization-group-size", type=int, choices=GROUP_SIZES, help="int4: weights per scale")
    parser.add_argument("--no-quantize-lm-head", dest="quantize_lm_head", action="store_false",
                        help="keep the LM head and the token embedding (tied or not) in full precision")
    parser.add_argument("--quantize-activations", action="store_true",
                        help="int8: round each linear's input rows to int8 too (int8 x int8 matmuls)")
    parser.add_argument("--num-threads", type=positive_int, help="CPU threads (default: every core)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of a sentence")
    args = parser.parse_args(argv)
    if args.window is not None and args.stride is not None and args.stride >= args.window:  # before the model loads
        parser.error(f"--stride must be below --window ({args.window}): windows overlap, got {args.stride}")
    try:  # a bad value: one line, with argparse's status for a bad argument, before the model loads
        if not is_cpu_or_cuda(args.device):
            raise ValueError(f"--device must be {CPU_OR_CUDA}, got {args.device!r}")
        check_quantization(args.quantization, args.quantization_group_size, args.quantize_lm_head,
                           args.quantize_activations)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        check_device(torch.device(args.device))
        if torch.device(args.device).type == "cpu":
            set_cpu_threads(args.num_threads)
        result, window, stride = file_perplexity(args.model, args.file, args.dtype, args.device, args.window,
                                                 args.stride, args.quantization, args.quantization_group_size,
                                                 args.quantize_lm_head, args.quantize_activations)
    except BadSetting as e:  # a window this model cannot take: a bad flag still
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(dict(model=args.model, file=args.file, dtype=args.dtype, quantization=args.quantization,
                              quantize_activations=args.quantize_activations,
                              group_size=args.quantization_group_size, window=window, stride=stride,
                              tokens=result.tokens, loss=result.loss, perplexity=result.perplexity)))
    else:
        print(f"perplexity {result.perplexity:.4f} (loss {result.loss:.4f} nats/token over {result.tokens} tokens; "
              f"windows of {window}, stride {stride}; {args.model}, {args.dtype}"
              f"{', ' + args.quantization if args.quantization else ''}"
              f"{' (int8 activations)' if args.quantize_activations else ''})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
