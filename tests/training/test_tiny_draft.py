"""minfer-tiny-draft, minfer-tiny's draft model for speculative decoding: found by name, the same tokenizer
byte for byte, a few times smaller, trained on the same text, and its card's figures reproduce."""

import re
from pathlib import Path

import torch
from model_cards import card_copy_figures
from tokenizers import Tokenizer

from minfer.models.gpt2 import GPT2
from minfer.models.loader import BUILTIN_MODELS, resolve_model_dir
from minfer.training.copying import copy_accuracy
from minfer.training.stories import stories
from minfer.training.train_tiny import TrainOptions, parse_args

TINY, DRAFT = BUILTIN_MODELS["minfer-tiny"], BUILTIN_MODELS["minfer-tiny-draft"]


def params(path: Path) -> int:
    model = GPT2.from_pretrained(path)
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_the_draft_resolves_and_shares_minfer_tinys_tokenizer():
    assert resolve_model_dir("minfer-tiny-draft") == DRAFT
    assert (DRAFT / "tokenizer.json").read_bytes() == (TINY / "tokenizer.json").read_bytes()
    assert (DRAFT / "heldout.txt").read_bytes() == (TINY / "heldout.txt").read_bytes()
    assert params(DRAFT) * 3 <= params(TINY)


def test_the_draft_card_states_how_it_was_trained():
    card = (DRAFT / "README.md").read_text(encoding="utf-8")
    command = re.search(r"## Reproducing it\n\n```bash\n(.+)\n```", card).group(1).split()
    assert command[:2] == ["python", "scripts/train_tiny.py"]
    out, opts, _ = parse_args(command[2:], "train_tiny")
    assert out == Path("minfer/models/builtin/minfer-tiny-draft")
    assert Path(opts.tokenizer) == Path("minfer/models/builtin/minfer-tiny")
    same = {"seed", "num_stories", "retell", "n_positions"}  # the same training text
    assert {k: getattr(opts, k) for k in same} == {k: getattr(TrainOptions(), k) for k in same}


def test_the_draft_card_figures_reproduce():
    """The card's held-out perplexity (minfer eval-ppl's method) and copy figures, on the shipped weights."""
    from minfer.bench.perplexity import perplexity

    torch.set_num_threads(1)
    model, tokenizer = GPT2.from_pretrained(DRAFT), Tokenizer.from_file(str(DRAFT / "tokenizer.json"))
    card = (DRAFT / "README.md").read_text(encoding="utf-8")
    stated = float(re.search(r"\| held-out perplexity [^|]*\| [\d.]+ \| ([\d.]+) \|", card).group(1))
    ids = torch.tensor(tokenizer.encode((DRAFT / "heldout.txt").read_text(encoding="utf-8")).ids)
    assert abs(perplexity(model, ids, 512, 256).perplexity - stated) <= 0.01 * stated
    score = copy_accuracy(model, tokenizer, stories("heldout-0", 200))
    forced, greedy = card_copy_figures(DRAFT)
    assert abs(score.teacher_forced - forced) < 0.002 and abs(score.greedy - greedy) < 0.002, (score, forced, greedy)
