"""Train small tokenizers offline, on text minfer ships (random checkpoints) or on a corpus given
(minfer-tiny's stories): byte-level BPE like GPT-2's, and SentencePiece-style BPE like Llama 2's."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterable

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
CORPUS = Path(__file__).parent / "data" / "corpus.txt"
SENTENCEPIECE_SPECIALS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2, as in Llama 2
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]  # ids 3-258: any byte a character falls back to
# Characters a SentencePiece-style vocabulary keeps whole although the corpus has them once: so a random
# model writes emoji as one token, while other rare characters (and the newline) are spelt in bytes.
WHOLE_CHARACTERS = ["😀", "🚀", "🤖", "🌍", "é", "ñ", "你", "好"]


def _training_text(seed: int, num_words: int, lines: bool = False):
    """The shipped corpus (whole, or line by line without the newlines), then seeded made-up words so a
    large vocabulary can be learned."""
    text = CORPUS.read_text(encoding="utf-8")
    yield from text.splitlines() if lines else [text]
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


def _alphabet(size: int) -> list[str]:
    """The `size` most frequent characters of the corpus's lines (a space as `▁`, one before each line), ties
    broken by code point, and WHOLE_CHARACTERS. Chosen here, not by the trainer, whose own choice among
    characters of equal count follows a hash map's order and so changed from process to process."""
    counts: dict[str, int] = {}
    for line in _training_text(0, 0, lines=True):
        for ch in "▁" + line.replace(" ", "▁"):
            counts[ch] = counts.get(ch, 0) + 1
    ranked = sorted(counts, key=lambda ch: (-counts[ch], ord(ch)))
    return sorted(set(ranked[:size]) | set(WHOLE_CHARACTERS))


def train_sentencepiece_tokenizer(vocab_size: int, alphabet_size: int = 100) -> Tokenizer:
    """A SentencePiece-style BPE tokenizer like Llama 2's, with exactly `vocab_size` ids: <unk>, <s>, </s>,
    then the 256 byte tokens <0x00>..<0xFF>, then the learned pieces. A space is written `▁` (Metaspace,
    one put before the text too); a character outside the vocabulary falls back to its UTF-8 bytes; the
    decoder turns `▁` back into spaces and byte tokens into characters, and drops the space put first.
    The post-processor puts <s> before every prompt.

    Trained on the shipped corpus, line by line (so the newline is left to byte fallback), keeping the
    `alphabet_size` most frequent characters and WHOLE_CHARACTERS."""
    learned = vocab_size - len(SENTENCEPIECE_SPECIALS) - len(BYTE_TOKENS)
    if learned < alphabet_size:
        least = len(SENTENCEPIECE_SPECIALS) + len(BYTE_TOKENS) + alphabet_size
        raise ValueError(f"vocab_size must be at least {least} (the special and byte tokens and the alphabet), "
                         f"got {vocab_size}")
    metaspace = dict(replacement="▁", prepend_scheme="first")
    alphabet = _alphabet(alphabet_size)
    trainer = trainers.BpeTrainer(vocab_size=learned, limit_alphabet=len(alphabet), initial_alphabet=alphabet,
                                  show_progress=False)
    pieces = Tokenizer(models.BPE())
    pieces.pre_tokenizer = pre_tokenizers.Metaspace(**metaspace, split=True)  # learn no piece across words
    pieces.train_from_iterator(_training_text(0, 0, lines=True), trainer)
    if pieces.get_vocab_size() != learned:
        raise ValueError(f"the corpus gives only {pieces.get_vocab_size()} pieces; vocab_size {vocab_size} is "
                         "too large")
    learned_vocab = sorted(pieces.get_vocab().items(), key=lambda item: item[1])
    vocab = {t: i for i, t in enumerate(SENTENCEPIECE_SPECIALS + BYTE_TOKENS + [t for t, _ in learned_vocab])}
    merges = [tuple(pair) for pair in json.loads(pieces.to_str())["model"]["merges"]]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(**metaspace, split=False)
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SENTENCEPIECE_SPECIALS])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                       special_tokens=[("<s>", 1)])
    return tok
