"""Write a checkpoint with random weights: config.json, model.safetensors, tokenizer.json.

The Hugging Face Hub is not always reachable (CI, air-gapped machines), so tests,
tutorials and benchmarks run on checkpoints this module writes. They have exactly
the files and tensor names of a real checkpoint (GPT-2 in either layout found in
the wild; Qwen3 and Llama with their special tokens, chat template and
generation_config.json), so everything downstream exercises the real loading path.

    python -m minfer.random_model OUT_DIR [--config gpt2|tiny|qwen3-tiny|llama-tiny|qwen3-0.6b]
                                          [--layout hub|transformers]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

CONFIGS = {
    # The shape of openai-community/gpt2 (124M parameters).
    "gpt2": dict(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12),
    # Small enough that a test runs in milliseconds.
    "tiny": dict(vocab_size=512, n_positions=512, n_embd=64, n_layer=2, n_head=4),
}
LAYOUTS = ("hub", "transformers")
EOS_TOKEN = "<|endoftext|>"
CORPUS = Path(__file__).parent / "data" / "corpus.txt"


def make_config(preset: str = "tiny", **overrides) -> dict:
    """A config.json dict in the format transformers writes for GPT-2."""
    if preset not in CONFIGS:
        raise ValueError(f"unknown config preset {preset!r}; choose one of {sorted(CONFIGS)}")
    shape = {**CONFIGS[preset], **overrides}
    if shape["n_embd"] % shape["n_head"]:
        raise ValueError(f"n_embd ({shape['n_embd']}) must be divisible by n_head ({shape['n_head']})")
    embedding_std = shape.pop("initializer_range", 0.02)
    eos = shape["vocab_size"] - 1  # like GPT-2, <|endoftext|> is the last id
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        **shape,
        "n_ctx": shape["n_positions"],
        "n_inner": None,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": 1e-5,
        "initializer_range": embedding_std,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "bos_token_id": eos,
        "eos_token_id": eos,
        "tie_word_embeddings": True,
    }


def random_state_dict(config: dict, layout: str = "hub", seed: int = 0) -> dict[str, torch.Tensor]:
    """Random fp32 weights under GPT-2's own tensor names (Conv1D weights are [in, out])."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose one of {LAYOUTS}")
    g = torch.Generator().manual_seed(seed)
    C, V, P = config["n_embd"], config["vocab_size"], config["n_positions"]
    hidden = config.get("n_inner") or 4 * C
    std = config.get("initializer_range", 0.02)  # embeddings; linear layers scale by fan-in

    def normal(*shape, scale=std):
        return torch.randn(*shape, generator=g) * scale

    def linear(fan_in, fan_out):  # O(1) outputs, so each block really changes the residual stream
        return normal(fan_in, fan_out, scale=fan_in**-0.5), normal(fan_out)

    def norm_weight():  # near 1, but not exactly, so a mix-up of weight and bias shows
        return 1.0 + normal(C, scale=0.1)

    sd = {"wte.weight": normal(V, C), "wpe.weight": normal(P, C, scale=0.01)}
    for i in range(config["n_layer"]):
        p = f"h.{i}."
        sd[p + "ln_1.weight"], sd[p + "ln_1.bias"] = norm_weight(), normal(C)
        sd[p + "attn.c_attn.weight"], sd[p + "attn.c_attn.bias"] = linear(C, 3 * C)
        sd[p + "attn.c_proj.weight"], sd[p + "attn.c_proj.bias"] = linear(C, C)
        sd[p + "ln_2.weight"], sd[p + "ln_2.bias"] = norm_weight(), normal(C)
        sd[p + "mlp.c_fc.weight"], sd[p + "mlp.c_fc.bias"] = linear(C, hidden)
        sd[p + "mlp.c_proj.weight"], sd[p + "mlp.c_proj.bias"] = linear(hidden, C)
        if layout == "hub":
            # The Hub's gpt2 file carries the causal mask as a buffer; loaders must skip it.
            sd[p + "attn.bias"] = torch.tril(torch.ones(P, P)).view(1, 1, P, P)
    sd["ln_f.weight"], sd["ln_f.bias"] = norm_weight(), normal(C)
    if layout == "transformers":
        sd = {"transformer." + k: v for k, v in sd.items()}
    return sd


def _training_text(seed: int, num_words: int):
    """The shipped corpus, then seeded made-up words so a large vocabulary can be learned."""
    yield CORPUS.read_text(encoding="utf-8")
    rng = random.Random(seed)
    syllables = (
        "ka to ri mu sen lo pa qui zer ban dor el fi gro hu in ja ku ly mo ne ox pi que ra st tu un vo wy xa ze".split()
    )
    words = ["".join(rng.choice(syllables) for _ in range(rng.randint(1, 5))) for _ in range(num_words)]
    for i in range(0, len(words), 2000):
        yield " ".join(words[i : i + 2000])


def train_tokenizer(vocab_size: int, seed: int = 0, special_tokens: list[str] = [EOS_TOKEN]) -> Tokenizer:
    """A byte-level BPE tokenizer like GPT-2's, with exactly `vocab_size` ids (the special tokens last)."""
    if vocab_size < 257 + len(special_tokens):
        raise ValueError(
            f"vocab_size must be at least {257 + len(special_tokens)} (256 bytes, the special tokens and "
            f"1 merge), got {vocab_size}"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    num_words = 0 if vocab_size <= 1024 else 8 * vocab_size
    tok.train_from_iterator(_training_text(seed, num_words), trainer)
    tok.add_special_tokens(special_tokens)
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok


def write_random_checkpoint(
    out_dir: str | Path, preset: str = "tiny", layout: str = "hub", seed: int = 0, **overrides
) -> Path:
    """Write config.json, model.safetensors, tokenizer.json (+ tokenizer_config.json) to out_dir."""
    from .random_llama import LLAMA_CONFIGS, write_random_llama  # it builds on this module

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if preset in LLAMA_CONFIGS:
        return write_random_llama(out, preset, seed, **overrides)
    config = make_config(preset, **overrides)
    tensors = random_state_dict(config, layout, seed)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    train_tokenizer(config["vocab_size"], seed).save(str(out / "tokenizer.json"))
    tok_config = {
        "tokenizer_class": "GPT2Tokenizer",
        "model_max_length": config["n_positions"],
        "bos_token": EOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    return out


def main(argv: list[str] | None = None) -> None:
    from .random_llama import LLAMA_CONFIGS

    parser = argparse.ArgumentParser(
        prog="python -m minfer.random_model",
        description="Write a GPT-2, Qwen3 or Llama checkpoint with random weights (for tests and offline use).",
    )
    parser.add_argument("out_dir", help="directory to write (created if missing)")
    parser.add_argument("--config", choices=sorted(CONFIGS) + list(LLAMA_CONFIGS), default="tiny", help="model shape")
    parser.add_argument("--layout", choices=LAYOUTS, default="hub", help="tensor-name layout")
    parser.add_argument("--seed", type=int, default=0, help="seed for the weights and tokenizer")
    args = parser.parse_args(argv)
    out = write_random_checkpoint(args.out_dir, args.config, args.layout, args.seed)
    layout = "" if args.config in LLAMA_CONFIGS else f" ({args.layout} layout)"
    print(f"wrote a random {args.config} checkpoint{layout} to {out}")


if __name__ == "__main__":
    main()
