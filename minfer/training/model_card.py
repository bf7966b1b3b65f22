"""The model card (README.md) train_tiny.py writes beside the weights: shape, data, training, figures."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import torch
from tokenizers import Tokenizer
from torch import nn

from ..cpu.features import cpu_name
from ..models.registry import load_model
from .tiny_shapes import describe

SAMPLE_PROMPTS = ["Once upon a time", "One day, Lily went to", "Tom said, \""]


@torch.inference_mode()
def greedy(model: nn.Module, tokenizer: Tokenizer, prompt: str, max_tokens: int = 120) -> str:
    """Greedy continuation with the plain forward (no cache: the model is tiny), up to <|endoftext|>."""
    ids = tokenizer.encode(prompt).ids
    eos = model.config.vocab_size - 1
    for _ in range(max_tokens):
        next_id = int(model(torch.tensor([ids[-model.config.max_positions :]]))[0, -1].argmax())
        if next_id == eos:
            break
        ids.append(next_id)
    return tokenizer.decode(ids)


def purpose(o: dict) -> str:
    if o["copy_warmup_steps"] and not o["tokenizer"]:
        return ("A model that copies from its context, which minfer-tiny (GPT-2, the same stories and tokenizer) "
                "does not learn at this size: the model speculative decoding's figures are measured on, since "
                "n-gram proposals (prompt lookup) pay only when the model repeats what it read.")
    if o["tokenizer"]:  # trained with another model's tokenizer: a draft for the models that share it
        return (f"A draft model for speculative decoding: the tokenizer of `{o['tokenizer']}` (`--tokenizer`) and "
                "the same training text, in a smaller forward, so it proposes tokens cheaply for a larger model "
                "with that tokenizer to verify (minfer-tiny's and minfer-tiny-llama's are the same).")
    return ("Output a person can read, offline, in a few megabytes: for the README's offline recipe, the "
            "tutorials without the Hub, and as a yardstick (held-out perplexity) for quantization and "
            "speculative decoding.")


def tokenizer_origin(o: dict) -> str:
    if o["tokenizer"]:
        return f"the tokenizer is `{o['tokenizer']}`'s (`--tokenizer`)"
    return f"the tokenizer was trained (minfer's `train_tokenizer`) on the first {o['tokenizer_stories']:,}"


def start(o: dict) -> str:
    if o["init"]:
        return (f"starting from the trained weights in `{o['init']}` (`--init`: the first command under "
                "Reproducing it), not from scratch")
    return "GPT-2's initialisation (tiny_shapes.py)"


def warmup_text(w: dict | None) -> str:
    """The copy warm-up's paragraph (copy_warmup.py), or nothing when there was none."""
    if not w:
        return ""
    return (f"\n\nBefore the stories: a copy warm-up (`--copy-warmup-steps`, minfer/training/copy_warmup.py) of "
            f"{w['steps']:,} steps on rows that tell a run of 8-30 random tokens twice, with the MLPs switched off, "
            f"ending at a drill loss of {w['drill_loss']:.2f} nats (guessing: {w['guess_loss']:.2f}; copying "
            f"perfectly: {w['copying_loss']:.2f}). It is there to form the heads that copy from the context, which the "
            "stories alone never formed at this size (how much copying survives the stories is under Results); the "
            "stories then start with a fresh optimizer.")


def init_command(init: str, prog: str) -> str | None:
    """The command that trained the checkpoint `--init` names, from its own card, written to `init`. A card
    whose command has no --retell trained without retellings: `--retell 0` is added to say so."""
    card = Path(init) / "README.md"
    if not card.is_file():
        return None
    found = re.search(r"## Reproducing it\n\n```bash\n(.+)\n```", card.read_text(encoding="utf-8"))
    if not found:
        return None
    argv = shlex.split(found.group(1))[len(shlex.split(prog)) :]
    argv = [init, *argv[1:]] + ([] if "--retell" in argv else ["--retell", "0"])
    return " ".join([prog, *map(shlex.quote, argv)])


def card_text(r: dict, name: str, command: str, check: str, samples: list[str], weights_bytes: int) -> str:
    o, c = r["options"], r["copy_accuracy"]
    curve = "\n".join(f"| {step} | {train:.4f} | {held:.4f} |" for step, train, held in r["curve"])
    first = sum(r["losses"][:5]) / 5
    sample_lines = "\n".join(f"> {s}\n" for s in samples)
    threads = f"{o['threads']} thread" + ("s" if o["threads"] != 1 else "")
    family, classes, mlp_width = describe(r["config"])
    return f"""# {name}

A {r['parameters'] / 1e6:.2f}M-parameter {family} trained from scratch on a CPU by minfer's own script, on simple
stories from a grammar minfer ships. {purpose(o)} It knows only its grammar's ~270 words: it is a toy, not a
language model of English.

```bash
python -m minfer.generate --model {name} --temperature 0 "Once upon a time"
minfer eval-ppl --model {name} minfer/models/builtin/{name}/heldout.txt
```

Licence: MIT, like minfer. The training text is generated, so nothing here comes from anyone else's data.

## Shape

| | |
| --- | --- |
| architecture | {classes} |
| layers, heads, channels | {o['n_layer']}, {o['n_head']}, {o['n_embd']} (MLP {mlp_width}) |
| context | {o['n_positions']} tokens |
| vocabulary | {r['vocab_size']}: byte-level BPE, `<|endoftext|>` last (id {r['vocab_size'] - 1}) |
| parameters | {r['parameters']:,} (LM head tied to the token embedding) |
| weights | {o['dtype']}, model.safetensors {weights_bytes / 1e6:.2f} MB |

## Training data

Stories from the probabilistic grammar in `minfer/training/stories.py` (TinyStories-like: an opening,
what the hero likes, an outing, a find, a problem, dialogue, a solution, an ending), one per line, each
ended by `<|endoftext|>`. {o['num_stories']:,} training stories from seed {o['seed']};
{tokenizer_origin(o)}. After each story, with chance
{o['retell']} (`--retell`), one of the last three is told again word for word (`with_retellings` in stories.py):
text that repeats itself, as real text does, from which a model can learn to copy from its context (what
n-gram speculative decoding needs; how far this one did is under Results). \
With the retellings the training text is {r['train_tokens']:,} tokens.
`heldout.txt` holds {o['heldout_stories']} more stories from their own seed stream
(`"heldout-{o['seed']}"`), {r['heldout_tokens']:,} tokens, never trained on, without retellings.

## Training

{o['steps']:,} steps of AdamW (betas 0.9/0.95, weight decay {o['weight_decay']} on matrices), batches of
{o['batch_size']} windows of {o['n_positions']} tokens at random offsets ({r['tokens_seen']:,} tokens,
{r['tokens_seen'] / r['train_tokens']:.2f} passes over the data), learning rate {o['lr']} \
after {o['warmup_steps']} warm-up
steps, cosine decay to a tenth; gradients clipped to norm 1; {start(o)}.{warmup_text(r.get('copy_warmup'))}

| step | train loss (last {o['eval_every']} steps) | held-out loss |
| --- | --- | --- |
{curve}

## Results

Loss in nats per token; perplexity = exp(loss). Both by `minfer eval-ppl`'s method (windows of the
context, stride half of it, every token but the first scored once) on the written weights, in float32:
"train" on the first {r['heldout_tokens']:,} tokens of the training text, "held-out" on `heldout.txt`.

| | loss | perplexity |
| --- | --- | --- |
| train | {r['train_loss']:.4f} | {r['train_perplexity']:.4f} |
| held-out perplexity (heldout.txt) | {r['heldout_loss']:.4f} | {r['heldout_perplexity']:.4f} |

Copying, on `bench.py --workload copy`'s prompt (two stories of heldout.txt, then the first one's opening
sentence again; minfer/training/copying.py, 20 prompts): of the first story's remaining tokens,
{100 * c['teacher_forced']:.1f}% are the model's greedy choice given the true ones before, and greedy decoding
writes {100 * c['greedy']:.1f}% of them before its first difference.

Greedy continuations (temperature 0):

{sample_lines}
## Reproducing it

```bash
{command}
```

Training took {r['train_seconds'] / 60:.1f} minutes ({r['total_seconds'] / 60:.1f} with data and evaluation) on
{threads} of an {r['cpu']} ({os.cpu_count()} cores seen), torch {torch.__version__}.
Every random choice comes from `--seed`, so the same command with the same `--threads` on the same
machine writes bit-identical weights (tests/training/test_trained_tiny.py checks that on a shortened run).
A quick check that a machine follows the same path: `{check}`
prints `step 5/5: train loss {first:.4f}`, the mean of this run's first five steps (neither warm-up,
of the learning rate or of copying, depends on `--steps`). \
Another CPU or thread count rounds matmuls differently and the weights
drift apart; the losses should land close, but by how much has not been measured.
"""


def write_card(out: Path, results: dict, prog: str, argv: list[str]) -> None:
    """README.md for the checkpoint at `out`, from train()'s results."""
    model = load_model(out)
    tokenizer = Tokenizer.from_file(str(out / "tokenizer.json"))
    samples = [greedy(model, tokenizer, p) for p in SAMPLE_PROMPTS]
    command = " ".join([prog, *map(shlex.quote, argv)])
    init = results["options"]["init"]
    if init:  # first the model it went on from
        command = f"{init_command(init, prog) or '# train the checkpoint in ' + init}\n{command}"
    # The same options for 5 steps, written elsewhere (argparse keeps the last --steps given).
    check_argv = ["/tmp/minfer-tiny-check" if Path(a) == out else a for a in argv] + ["--steps", "5", "--no-card"]
    check = " ".join([prog, *map(shlex.quote, check_argv)])
    results = {**results, "cpu": cpu_name(), "vocab_size": model.config.vocab_size}
    text = card_text(results, out.name, command, check, samples, (out / "model.safetensors").stat().st_size)
    (out / "README.md").write_text(text, encoding="utf-8")
