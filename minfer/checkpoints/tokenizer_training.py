"""Train a small byte-level BPE tokenizer like GPT-2's, offline: on text minfer ships (random checkpoints)
or on a corpus given (minfer-tiny's stories)."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
CORPUS = Path(__file__).parent / "data" / "corpus.txt"


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


def train_tokenizer(
    vocab_size: int, seed: int = 0, special_tokens: list[str] = [EOS_TOKEN], corpus: Iterable[str] | None = None
) -> Tokenizer:
    """A byte-level BPE tokenizer like GPT-2's, with exactly `vocab_size` ids (the special tokens last).

    Trained on `corpus` (texts) if given, else on the shipped corpus and words made up from `seed`.
    A corpus too small to give `vocab_size` distinct tokens raises ValueError."""
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
    if corpus is None:
        num_words = 0 if vocab_size <= 1024 else 8 * vocab_size
        corpus = _training_text(seed, num_words)
    tok.train_from_iterator(corpus, trainer)
    tok.add_special_tokens(special_tokens)
    if tok.get_vocab_size() < vocab_size:  # BPE ran out of pairs to merge
        raise ValueError(f"the corpus gives only {tok.get_vocab_size()} tokens; vocab_size {vocab_size} is too large")
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, wanted {vocab_size}")
    return tok
