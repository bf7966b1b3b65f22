"""The bytes each token adds to the text, whatever the kind of tokenizer: what logprobs show for a token
(its text, and chat's `bytes`), and which ids a benchmark's random prompt may use.

How a vocabulary spells bytes depends on its decoder:
- byte-level BPE (GPT-2, Qwen, Llama 3): every character of a token stands for one byte, through
  GPT-2's byte table (`Ġ` is a space, `Ċ` a newline);
- SentencePiece-style (Llama 2, Mistral, Gemma): `▁` is a space, and with byte fallback the token
  `<0x0A>` is the byte 0x0A;
- any other decoder (WordPiece, BPEDecoder, none): what the decoder makes of the token between two others,
  so a WordPiece word starts with its space and `##ing` adds 'ing' (decoded alone, either is a text's first
  token, spelt otherwise).
Special tokens add no bytes (b"").
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from functools import lru_cache

import tokenizers

BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")  # a byte-fallback token: <0x00> ... <0xFF>
PER_TOKEN_STEPS = {"Replace", "Metaspace", "ByteFallback", "Fuse", "Strip"}  # steps read token by token below


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters.

    Byte-level BPE vocabularies store tokens as strings, so every byte needs a
    visible, non-whitespace stand-in. Bytes that are already printable Latin-1
    characters stand for themselves; the others (controls, space, 0x7F-0xA0,
    soft hyphen) are given code points 256, 257, ... in byte order.
    """
    printable = set(range(ord("!"), ord("~") + 1))
    printable |= set(range(ord("¡"), ord("¬") + 1)) | set(range(ord("®"), ord("ÿ") + 1))
    table, shifted = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


@lru_cache(maxsize=1)
def unicode_to_bytes() -> dict[str, int]:
    return {ch: b for b, ch in bytes_to_unicode().items()}


def decoder_steps(backend: tokenizers.Tokenizer) -> list[dict]:
    """The decoder's steps as tokenizer.json writes them ({"type": "ByteLevel", ...}), a Sequence unrolled."""
    if backend.decoder is None:
        return []
    spec = json.loads(backend.decoder.__getstate__())
    return spec["decoders"] if spec["type"] == "Sequence" else [spec]


def byte_fallback_ids(backend: tokenizers.Tokenizer) -> frozenset[int]:
    """The ids of the byte tokens <0x00>..<0xFF> if the decoder turns them back into bytes, else none."""
    if not any(step["type"] == "ByteFallback" for step in decoder_steps(backend)):
        return frozenset()
    ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
    return frozenset(i for i in ids if i is not None)


def token_bytes_table(backend: tokenizers.Tokenizer) -> list[bytes]:
    """table[id]: the bytes the token adds to decoded text; b"" for special tokens."""
    steps = decoder_steps(backend)
    kinds = {step["type"] for step in steps}
    special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
    table = [b""] * backend.get_vocab_size(with_added_tokens=True)
    inner_bytes = inner_spelling(backend.decoder)
    for token, i in backend.get_vocab(with_added_tokens=True).items():
        if not 0 <= i < len(table) or i in special:
            continue
        if "ByteLevel" in kinds:
            table[i] = byte_level_bytes(token)
        elif steps and kinds <= PER_TOKEN_STEPS:
            table[i] = sentencepiece_bytes(token, steps)
        else:
            table[i] = inner_bytes(token)
    return table


def inner_spelling(decoder: tokenizers.decoders.Decoder | None) -> Callable[[str], bytes]:
    """token -> the bytes it adds inside a text: what the decoder makes of it between an `a` and a `b` (a text's
    first and last tokens may be spelt otherwise: WordPiece puts no space before the first, BPEDecoder none
    after the last). Without a decoder, decode() joins tokens with spaces."""
    if decoder is None:
        return lambda token: f" {token}".encode("utf-8")
    before = decoder.decode(["a"])  # the frame around the token, the same for every one
    after = decoder.decode(["a", "b"])[len(before) :]

    def spelt(token: str) -> bytes:
        text = decoder.decode(["a", token, "b"])
        if text.startswith(before) and text.endswith(after) and len(text) >= len(before) + len(after):
            return text[len(before) : len(text) - len(after)].encode("utf-8")
        return decoder.decode([token]).encode("utf-8")  # a decoder that reads tokens together: the token alone

    return spelt


def byte_level_bytes(token: str) -> bytes:
    """The bytes a byte-level token stands for, as the `tokenizers` ByteLevel decoder computes them:
    each character mapped back to its byte, or, if any character is not in the table (an added token
    holding a real space), the token's own UTF-8."""
    inverse = unicode_to_bytes()
    try:
        return bytes(inverse[ch] for ch in token)
    except KeyError:
        return token.encode("utf-8")


def sentencepiece_bytes(token: str, steps: list[dict]) -> bytes:
    """The bytes of a SentencePiece-style token: a byte token is its byte; any other is its text with the
    decoder's replacements made (`▁` -> space). Fuse and Strip act on the whole text, not on one token."""
    kinds = {step["type"] for step in steps}
    if "ByteFallback" in kinds and BYTE_TOKEN.fullmatch(token):
        return bytes([int(token[3:5], 16)])
    for step in steps:
        if step["type"] == "Replace" and "String" in step["pattern"]:
            token = token.replace(step["pattern"]["String"], step["content"])
        elif step["type"] == "Metaspace":
            token = token.replace(step["replacement"], " ")
    return token.encode("utf-8")
