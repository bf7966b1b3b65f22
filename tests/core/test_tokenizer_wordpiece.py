"""Tokenizers whose decoder is neither byte-level nor SentencePiece-style: WordPiece (BERT's `##`), BPEDecoder
(CLIP's `</w>`) and none at all. Each token's bytes are what it adds inside a text, so logprobs show them and
text_offset counts them as the streamed text has them. (They were the token decoded alone: `##el` counted
four characters where the text has 'el', and a word its own length without the space before it.)"""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers, pre_tokenizers

from minfer.text.text_offsets import TextOffsets
from minfer.text.tokenizer import Tokenizer

WORDS = ["[UNK]", "[SEP]", "!", "h", "##el", "##lo", "hello", "world", ".", "don", "'", "t", "n", "##'t", "日", "本"]


def wordpiece(cleanup: bool) -> Tokenizer:
    backend = tokenizers.Tokenizer(models.WordPiece({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer(lowercase=True)
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    backend.decoder = decoders.WordPiece(cleanup=cleanup)
    backend.add_special_tokens(["[UNK]", "[SEP]"])
    return Tokenizer(backend, eos_token_id=1)


def bpe(decoder) -> Tokenizer:
    words = ["a</w>", "b</w>", "ab", "c</w>", "abc</w>", "x</w>", "!</w>"]
    backend = tokenizers.Tokenizer(models.BPE({w: i for i, w in enumerate(words)}, [], end_of_word_suffix="</w>"))
    backend.decoder = decoder
    return Tokenizer(backend)


def streamed(tok: Tokenizer, context: list[int], ids: list[int]) -> str:
    d = tok.detokenizer(context=context)
    return "".join(d.add(i) for i in ids) + d.flush()


def test_wordpiece_tokens_add_their_space_or_their_bare_text():
    tok = wordpiece(cleanup=True)
    spelt = {w: tok.token_bytes[tok.token_to_id(w)] for w in ("hello", "##el", ".", "##'t", "[SEP]")}
    assert spelt == {"hello": b" hello", "##el": b"el", ".": b".", "##'t": b"'t", "[SEP]": b""}
    assert tok.drops_first_space  # a text's first word has no space before it: `hello` alone is 'hello'
    assert wordpiece(cleanup=False).token_bytes[tok.token_to_id(".")] == b" ."


@pytest.mark.parametrize("cleanup", [True, False])
@pytest.mark.parametrize("text", ["hello world.", "hello hello don't 日本", "h ##el !"])
def test_wordpiece_offsets_index_the_streamed_text(cleanup, text):
    """After a prompt the text continues it; without one (starts_text) its first space is dropped."""
    tok = wordpiece(cleanup)
    prompt, ids = tok.encode("hello"), tok.encode(text)
    for context, starts_text in ((prompt, False), ([], True)):
        shown = streamed(tok, context, ids)
        counter = TextOffsets(tok, starts_text=starts_text)
        offsets = counter.offsets(ids)
        assert counter.text_offset == len(shown), (shown, offsets)
        for n, (offset, i) in enumerate(zip(offsets, ids)):
            piece = tok.token_bytes[i].decode()
            if n == 0 and starts_text:
                piece = piece.removeprefix(" ")
            assert shown[offset : offset + len(piece)] == piece, (shown, offsets, n)


@pytest.mark.parametrize("decoder, text, expected", [
    (decoders.BPEDecoder(suffix="</w>"), "abc abc x !", [0, 2, 4, 8, 10]),  # a word's space after it, none at the end
    (None, "ab c</w> abc</w> x</w> !</w>", [0, 2, 8, 16, 22]),  # no decoder: decode() joins the tokens with spaces
])
def test_other_decoders_offsets_index_the_text(decoder, text, expected):
    tok = bpe(decoder)
    ids = [tok.token_to_id(w) for w in ("ab", "c</w>", "abc</w>", "x</w>", "!</w>")]
    assert tok.decode(ids) == streamed(tok, [], ids) == text
    spelt = [tok.token_bytes[i].decode() for i in ids]
    assert spelt == (["ab", "c ", "abc ", "x ", "! "] if decoder else [" ab", " c</w>", " abc</w>", " x</w>", " !</w>"])
    offsets = TextOffsets(tok, starts_text=True).offsets(ids)
    assert offsets == expected
