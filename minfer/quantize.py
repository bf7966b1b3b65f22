"""`minfer quantize SRC DST --quantization int8` (or `python -m minfer.quantize`): write a quantized checkpoint.

SRC is a full-precision checkpoint (a directory, a built-in name such as minfer-tiny, or a Hub id); it
is quantized tensor by tensor as it loads (the float model is never in memory whole) and DST gets
model.safetensors with the quantized tensors and their scales, config.json with a
`quantization_config`, and SRC's tokenizer. Loading DST (`--model DST`) skips quantizing.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from .checkpoints.files import config_of, why_not_write_into
from .engine.config import DTYPES
from .models.registry import load_model
from .quantization import GROUP_SIZES, QUANTIZATION_METHODS
from .quantization.checkpoint import FORMAT_NAME, QuantizationSpec, QuantizedWeights, save_quantized


def main(argv: list[str] | None = None, prog: str = "python -m minfer.quantize") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    parser.add_argument("src", help="full-precision checkpoint: directory, built-in name or Hub id")
    parser.add_argument("dst", help="directory to write the quantized checkpoint to")
    parser.add_argument("--quantization", required=True, choices=QUANTIZATION_METHODS)
    parser.add_argument("--quantization-group-size", type=int, choices=GROUP_SIZES, help="int4: weights per scale")
    parser.add_argument("--no-quantize-lm-head", dest="quantize_lm_head", action="store_false",
                        help="keep the LM head and the token embedding (tied or not) in full precision")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                        help="dtype of the tensors left in full precision (norms, biases; default float32, which "
                        "holds fp32, bf16 and fp16 sources exactly: DST then loads in any --dtype as SRC does)")
    parser.add_argument("--force", action="store_true", help="write into a directory that holds other files")
    args = parser.parse_args(argv)
    refusal = why_not_write_into(args.dst, holds_quantized_checkpoint, "quantized checkpoint", args.force)
    if refusal is not None:
        parser.error(refusal)
    try:  # flags that do not go together: a bad flag, before the model loads
        spec = QuantizationSpec(args.quantization, args.quantization_group_size, args.quantize_lm_head)
    except ValueError as e:
        parser.error(str(e))
    try:
        start = time.perf_counter()
        model = load_model(args.src, dtype=DTYPES[args.dtype], weights=QuantizedWeights(spec))
        if Path(model.model_dir).resolve() == Path(args.dst).resolve():  # its full-precision weights would be lost
            raise ValueError(f"{args.dst} is the checkpoint being quantized: write the quantized one elsewhere")
        if holds_quantized_checkpoint(Path(model.model_dir)):
            raise ValueError(f"{args.src} is quantized already: quantize its full-precision checkpoint")
        out = save_quantized(model, model.model_dir, args.dst, spec)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    size = (out / "model.safetensors").stat().st_size
    print(f"wrote {out} ({args.quantization}, {size / 1e6:.1f} MB) in {time.perf_counter() - start:.1f} s; "
          f"run it with --model {out}")
    return 0


def holds_quantized_checkpoint(directory: Path) -> bool:
    """Whether `directory` holds a checkpoint minfer quantized (ours to write over; no source to quantize)."""
    return (config_of(directory).get("quantization_config") or {}).get("quant_method") == FORMAT_NAME


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
