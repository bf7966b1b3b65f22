"""Train minfer-tiny: a small GPT-2 (or Llama), from scratch, on the story grammar's text, on a CPU.

    python scripts/train_tiny.py OUT_DIR [--n-layer 4 --n-embd 128 ...] [--steps N] [--tokenizer DIR]
    (also `minfer train-tiny OUT_DIR ...`)

The defaults are the shipped minfer-tiny's (minfer/models/builtin/minfer-tiny; the other shipped
models' cards give their commands). Every choice comes from `--seed`: the stories (stories.py), the
tokenizer trained on them, the initial weights and the order of the batches; with the same seed and
thread count on the same machine, the weights come out bit for bit the same.
- `--arch llama` trains minfer's Llama module instead of GPT2 (tiny_shapes.py), and
  `--copy-warmup-steps N` first drills it to copy from its context (copy_warmup.py);
- `--tokenizer DIR` reuses a trained model's tokenizer (a draft model for speculative decoding must
  share its target's); `--init DIR` starts from a trained model's weights.
The model is trained through its plain (B, T) forward; the result is an ordinary checkpoint
directory that minfer and transformers both load, with its held-out text and a model card.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer

from ..bench.perplexity import Perplexity, perplexity
from ..checkpoints.files import save_safetensors, why_not_write_into
from ..checkpoints.tokenizer_training import EOS_TOKEN, train_tokenizer
from .copy_warmup import copy_warmup
from .copying import copy_accuracy
from .model_card import write_card
from .stories import stories, with_retellings
from .tiny_shapes import ARCHS, build_model, checkpoint_tensors, init_weights, tiny_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class TrainOptions:
    arch: str = "gpt2"  # or "llama" (tiny_shapes.py)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    n_positions: int = 512  # context, and the training windows' length: the soak's long streams need 512
    vocab_size: int = 800
    steps: int = 3000
    batch_size: int = 8  # windows of n_positions tokens per step
    lr: float = 3e-3
    warmup_steps: int = 100
    weight_decay: float = 0.1
    num_stories: int = 120_000  # training stories; more than `steps` ever reads, so no story repeats much
    retell: float = 0.25  # chance a story is followed by a verbatim retelling of a recent one (stories.py)
    tokenizer_stories: int = 20_000  # the first stories, to train the tokenizer on
    heldout_stories: int = 200
    seed: int = 0
    threads: int = 2
    dtype: str = "float32"  # of the weights written
    eval_every: int = 250
    tokenizer: str | None = None  # a checkpoint directory whose tokenizer.json to reuse
    init: str | None = None  # a checkpoint directory to start from (its weights and tokenizer), not from scratch
    copy_warmup_steps: int = 0  # at most this many copy-drill steps before the stories (copy_warmup.py); 0: none


def story_lines(texts: list[str]) -> list[str]:
    """A story per line, ended by <|endoftext|>: how the model sees text, and what heldout.txt holds."""
    return [f"{t}{EOS_TOKEN}\n" for t in texts]


def tokenize(tokenizer: Tokenizer, lines: list[str]) -> torch.Tensor:
    """Every line's ids, end to end, as one stream."""
    ids = [i for enc in tokenizer.encode_batch(lines, add_special_tokens=False) for i in enc.ids]
    return torch.tensor(ids, dtype=torch.int32)


def lr_at(step: int, opts: TrainOptions) -> float:
    """Linear warm-up, then a cosine decay to a tenth of the peak."""
    if step < opts.warmup_steps:
        return opts.lr * (step + 1) / opts.warmup_steps
    progress = (step - opts.warmup_steps) / max(1, opts.steps - opts.warmup_steps)
    return opts.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def make_optimizer(model: nn.Module, opts: TrainOptions) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices only (not on biases, norms)."""
    params = {id(p): p for p in model.parameters()}.values()  # the tied embedding once
    decay = [p for p in params if p.dim() >= 2]
    other = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": opts.weight_decay}, {"params": other, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=opts.lr, betas=(0.9, 0.95), foreach=True)


# A story model's chat: each message a line of its own, and the reply the next line. A new line is
# where the stories it learned begin, so whatever is asked, the reply is a story.
STORY_CHAT_TEMPLATE = "{%- for message in messages %}{{ message['content'] | trim }}{{ '\\n' }}{%- endfor %}"


def write_checkpoint(model: nn.Module, config: dict, tokenizer: Tokenizer, out: Path, dtype: torch.dtype) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_safetensors(checkpoint_tensors(model, dtype), out / "model.safetensors")
    config = {**config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokenizer.save(str(out / "tokenizer.json"))
    eos, context = config["eos_token_id"], config.get("n_positions") or config["max_position_embeddings"]
    tok_config = dict(tokenizer_class="GPT2Tokenizer", model_max_length=context,
                      bos_token=EOS_TOKEN, eos_token=EOS_TOKEN, unk_token=EOS_TOKEN, chat_template=STORY_CHAT_TEMPLATE)
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(dict(bos_token_id=eos, eos_token_id=eos), indent=2) + "\n")


def evaluate(model: nn.Module, ids: torch.Tensor, window: int) -> Perplexity:
    """Held-out loss by the method `minfer eval-ppl` uses (bench/perplexity.py): windows of the
    context, stride half of it."""
    model.eval()
    result = perplexity(model, ids.long(), window, window // 2)
    model.train()
    return result


def train(opts: TrainOptions, out: Path, log=print) -> dict:
    """Train, write the checkpoint directory to `out`, and return the figures the model card states."""
    torch.set_num_threads(opts.threads)
    torch.manual_seed(opts.seed)
    start = time.perf_counter()

    texts = stories(opts.seed, opts.num_stories)
    heldout = stories(f"heldout-{opts.seed}", opts.heldout_stories)  # its own stream: no overlap by design
    if opts.tokenizer or opts.init:
        tokenizer = Tokenizer.from_file(str(Path(opts.tokenizer or opts.init) / "tokenizer.json"))
    else:
        tokenizer = train_tokenizer(opts.vocab_size, opts.seed, corpus=texts[: opts.tokenizer_stories])
    vocab_size = tokenizer.get_vocab_size()
    train_ids = tokenize(tokenizer, story_lines(with_retellings(texts, opts.retell, opts.seed)))
    heldout_ids = tokenize(tokenizer, story_lines(heldout))
    train_eval_ids = train_ids[: heldout_ids.numel()]  # the same amount of training text, scored the same way
    log(f"data: {len(texts)} stories, {train_ids.numel()} tokens; held out: {len(heldout)} stories, "
        f"{heldout_ids.numel()} tokens; vocabulary {vocab_size} ({time.perf_counter() - start:.1f} s)")

    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    config = tiny_config(opts.arch, vocab_size, eos_id, opts.n_positions, opts.n_embd, opts.n_layer, opts.n_head)
    model = build_model(config)
    init_weights(model, opts.n_layer)
    if opts.init:  # go on training a trained model (same shape), e.g. on text with retellings
        model.load_state_dict(ARCHS[opts.arch].from_pretrained(opts.init).state_dict())
    num_params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    log(f"model: {opts.arch}, {opts.n_layer} layers, {opts.n_head} heads, {opts.n_embd} channels, "
        f"context {opts.n_positions}: {num_params / 1e6:.2f}M parameters")

    warmup = None
    if opts.copy_warmup_steps:  # its own optimizer state and batches: the stories start as without it
        warmup = copy_warmup(model, make_optimizer(model, opts), opts.copy_warmup_steps, opts.lr, opts.seed,
                             vocab_size, eos_id, log)

    optimizer = make_optimizer(model, opts)
    batches = torch.Generator().manual_seed(opts.seed)
    T, B = opts.n_positions, opts.batch_size
    train_start, window_loss, losses, curve = time.perf_counter(), 0.0, [], []
    for step in range(opts.steps):
        offsets = torch.randint(0, train_ids.numel() - T - 1, (B,), generator=batches)
        rows = torch.stack([train_ids[o : o + T + 1] for o in offsets.tolist()]).long()  # (B, T + 1)
        x, y = rows[:, :-1], rows[:, 1:]
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, opts)
        logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, vocab_size), y.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        window_loss += loss.item()
        losses.append(loss.item())
        done = step + 1
        if done % opts.eval_every == 0 or done == opts.steps:
            n = (done - 1) % opts.eval_every + 1
            elapsed = time.perf_counter() - train_start
            held = evaluate(model, heldout_ids, T)
            curve.append((done, window_loss / n, held.loss))
            log(f"step {done}/{opts.steps}: train loss {window_loss / n:.4f}, held-out loss {held.loss:.4f}, "
                f"lr {lr_at(step, opts):.2e}, {done * B * T / elapsed:.0f} tokens/s, {elapsed:.0f} s")
            window_loss = 0.0
    train_seconds = time.perf_counter() - train_start

    dtype = DTYPES[opts.dtype]
    model = model.to(dtype).float()  # score exactly the weights that are written
    write_checkpoint(model, config, tokenizer, out, dtype)
    (out / "heldout.txt").write_text("".join(story_lines(heldout)), encoding="utf-8")
    held, seen = evaluate(model, heldout_ids, T), evaluate(model, train_eval_ids, T)
    copied = copy_accuracy(model, tokenizer, heldout)
    return dict(options=asdict(opts), parameters=num_params, train_tokens=train_ids.numel(),
                tokens_seen=opts.steps * B * T, heldout_tokens=heldout_ids.numel(),
                train_loss=seen.loss, train_perplexity=seen.perplexity,
                heldout_loss=held.loss, heldout_perplexity=held.perplexity, copy_accuracy=asdict(copied), curve=curve,
                copy_warmup=warmup, config=config,
                train_seconds=train_seconds, total_seconds=time.perf_counter() - start, losses=losses)


# The least each count may be: a shape or a batch of 0 trains nothing; 0 steps writes the initial weights.
LOWEST = {"n_layer": 1, "n_head": 1, "n_embd": 1, "n_positions": 2, "vocab_size": 1, "steps": 0, "batch_size": 1,
          "lr": 0, "warmup_steps": 0, "weight_decay": 0, "num_stories": 1, "tokenizer_stories": 1,
          "heldout_stories": 1, "threads": 1, "eval_every": 1, "copy_warmup_steps": 0}


def parse_args(argv: list[str] | None, prog: str) -> tuple[Path, TrainOptions, bool]:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("out_dir", help="checkpoint directory to write (created if missing)")
    parser.add_argument("--no-card", action="store_true", help="write no README.md model card")
    parser.add_argument("--force", action="store_true", help="write into a directory that holds other files")
    for f in fields(TrainOptions):
        kind = float if f.type == "float" else str if f.type in ("str", "str | None") else int
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    args = parser.parse_args(argv)
    opts = TrainOptions(**{f.name: getattr(args, f.name) for f in fields(TrainOptions)})
    if opts.dtype not in DTYPES:
        parser.error(f"--dtype must be one of {sorted(DTYPES)}")
    if opts.arch not in ARCHS:
        parser.error(f"--arch must be one of {sorted(ARCHS)}")
    for name, low in LOWEST.items():
        if getattr(opts, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(opts, name)}")
    if not 0 <= opts.retell <= 1:
        parser.error(f"--retell must be a chance in [0, 1], got {opts.retell}")
    # a directory train-tiny wrote holds heldout.txt, the shipped models' too
    refusal = why_not_write_into(args.out_dir, lambda out: (out / "heldout.txt").is_file(), "trained model", args.force)
    if refusal is not None:
        parser.error(refusal)
    return Path(args.out_dir), opts, not args.no_card


def main(argv: list[str] | None = None, prog: str = "python scripts/train_tiny.py") -> int:
    out, opts, card = parse_args(argv, prog)
    try:
        out.mkdir(parents=True, exist_ok=True)  # now, not after the training: a path that cannot be is one line
    except OSError as e:
        print(f"{prog}: error: cannot write {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    results = train(opts, out)
    if card:
        write_card(out, results, prog, argv if argv is not None else sys.argv[1:])
    print(f"wrote {out}: held-out loss {results['heldout_loss']:.4f}, perplexity {results['heldout_perplexity']:.3f} "
          f"(train {results['train_perplexity']:.3f}), greedy copy {results['copy_accuracy']['greedy']:.3f} "
          f"after {results['train_seconds']:.0f} s of training")
    return 0


if __name__ == "__main__":
    sys.exit(main())
