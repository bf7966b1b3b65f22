"""GPT-2 tokenizer: load from a checkpoint directory, encode, decode, and stream-decode.

The heavy lifting (BPE merges) is done by the `tokenizers` library. What we add:
loading from either file layout found in the wild, finding the EOS id, and an
incremental detokenizer that turns one generated token at a time into text
without ever re-decoding the whole sequence and without emitting half a
UTF-8 character.
"""

from __future__ import annotations

import codecs
import json
import operator
from functools import lru_cache
from pathlib import Path
from typing import Iterable, Sequence

import tokenizers
from tokenizers import AddedToken, decoders, models, pre_tokenizers

from ..errors import is_int

EOS_TOKEN = "<|endoftext|>"


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


def _token_to_bytes(token: str) -> bytes:
    """The bytes a token stands for, exactly as the `tokenizers` ByteLevel decoder computes them:
    map each character back to its byte, or, if any character is not in the table
    (e.g. an added token containing a real space), take the token's own UTF-8."""
    inverse = unicode_to_bytes()
    try:
        return bytes(inverse[ch] for ch in token)
    except KeyError:
        return token.encode("utf-8")


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}).") from None


class Tokenizer:
    """A GPT-2 style byte-level BPE tokenizer wrapping a `tokenizers.Tokenizer`."""

    def __init__(self, backend: tokenizers.Tokenizer, eos_token_id: int | list[int] | None = None):
        self.backend = backend
        # Every id that ends a generation (chat models name several: end of text, end of turn).
        ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        self.eos_token_ids: list[int] = [i for i in ids if i is not None]
        self._token_bytes: list[bytes] | None = None
        self._token_bytes_with_special: list[bytes] | None = None

    # ---- loading -------------------------------------------------------------------

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load tokenizer.json, or else vocab.json + merges.txt, from a checkpoint directory."""
        d = Path(model_dir)
        tok_json, vocab, merges = d / "tokenizer.json", d / "vocab.json", d / "merges.txt"
        if tok_json.is_file():
            try:
                backend = tokenizers.Tokenizer.from_file(str(tok_json))
            except Exception as e:  # tokenizers raises a bare Exception on bad input
                raise ValueError(f"{tok_json} is not a valid tokenizer.json ({e}).") from None
        elif vocab.is_file() and merges.is_file():
            backend = cls._from_vocab_merges(vocab, merges)
        else:
            raise FileNotFoundError(
                f"no tokenizer found in {d}: looked for tokenizer.json, or vocab.json with merges.txt."
            )
        return cls(backend, _find_eos_ids(d, backend))

    @staticmethod
    def _from_vocab_merges(vocab: Path, merges: Path) -> tokenizers.Tokenizer:
        """Rebuild GPT-2's tokenizer from the original OpenAI-style files."""
        try:
            bpe = models.BPE.from_file(str(vocab), str(merges))
        except Exception as e:
            raise ValueError(f"cannot build a BPE tokenizer from {vocab} and {merges} ({e}).") from None
        backend = tokenizers.Tokenizer(bpe)
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = decoders.ByteLevel()
        if backend.token_to_id(EOS_TOKEN) is not None:
            # Special, so the literal text "<|endoftext|>" maps to the one id and decode() skips it.
            backend.add_special_tokens([AddedToken(EOS_TOKEN, special=True, normalized=False)])
        return backend

    @property
    def eos_token_id(self) -> int | None:
        """The main end-of-sequence id: the first the checkpoint names."""
        return self.eos_token_ids[0] if self.eos_token_ids else None

    # ---- vocabulary ----------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id) if 0 <= token_id < self.vocab_size else None

    @property
    def token_bytes(self) -> list[bytes]:
        """token_bytes[id] is the bytes that token contributes to decoded text (b'' for specials).

        Built once, on first use: it is what lets streaming work per token in O(1)."""
        if self._token_bytes is None:
            self._token_bytes = self._bytes_table(skip_special_tokens=True)
        return self._token_bytes

    def _bytes_table(self, skip_special_tokens: bool) -> list[bytes]:
        added = self.backend.get_added_tokens_decoder()
        special = {i: t.content for i, t in added.items() if t.special}
        table = [b""] * self.vocab_size
        for token, i in self.backend.get_vocab(with_added_tokens=True).items():
            if 0 <= i < len(table) and i not in special:
                table[i] = _token_to_bytes(token)
        if not skip_special_tokens:  # a special token's text is its content, as written
            for i, content in special.items():
                if 0 <= i < len(table):
                    table[i] = content.encode("utf-8")
        return table

    # ---- encode / decode -----------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """The text's ids, nothing added (special tokens written in the text are still one id each)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the model was trained to see one: with what the checkpoint's post-processor
        adds around it, such as Llama 3's <|begin_of_text|>. GPT-2 and Qwen3 add nothing. (A chat
        template writes these tokens itself, so rendered chats go through encode.)"""
        return self.backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text for `ids`, skipping special tokens and ids outside the vocabulary.

        Invalid UTF-8 (e.g. a sequence cut mid-character) renders as U+FFFD."""
        n = self.vocab_size
        valid = [i for i in map(operator.index, ids) if 0 <= i < n]
        return self.backend.decode(valid, skip_special_tokens=True)

    def detokenizer(self, skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        """A streaming decoder; with skip_special_tokens=False special tokens render as their text."""
        if not isinstance(self.backend.decoder, decoders.ByteLevel):
            raise ValueError(
                f"streaming decode needs a byte-level (GPT-2 style) tokenizer, "
                f"but this one's decoder is {type(self.backend.decoder).__name__}."
            )
        if skip_special_tokens:
            return IncrementalDetokenizer(self.token_bytes)
        if self._token_bytes_with_special is None:
            self._token_bytes_with_special = self._bytes_table(skip_special_tokens=False)
        return IncrementalDetokenizer(self._token_bytes_with_special)


def read_eos_token_ids(model_dir: str | Path) -> list[int]:
    """Every end-of-sequence id the checkpoint names: config.json's eos_token_id, then
    generation_config.json's (either may be one id or a list; chat models list their
    end-of-turn token there too). The one place EOS ids are parsed."""
    ids: list[int] = []
    for name in ("config.json", "generation_config.json"):
        path = Path(model_dir) / name
        if not path.is_file():
            continue
        try:
            eos = json.loads(path.read_text(encoding="utf-8")).get("eos_token_id")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise ValueError(f"{path} is not a valid JSON object: {e}") from None
        for i in eos if isinstance(eos, list) else [eos]:
            if is_int(i) and i >= 0 and i not in ids:
                ids.append(i)
    return ids


def _find_eos_ids(d: Path, backend: tokenizers.Tokenizer) -> list[int]:
    """The ids config.json and generation_config.json name come first (the first is the EOS);
    then tokenizer_config.json's eos_token; failing all of them, GPT-2's usual token."""
    ids = read_eos_token_ids(d)
    if (d / "tokenizer_config.json").is_file():
        eos = _read_json(d / "tokenizer_config.json").get("eos_token")
        if isinstance(eos, dict):  # the serialized AddedToken form
            eos = eos.get("content")
        if isinstance(eos, str) and backend.token_to_id(eos) is not None and backend.token_to_id(eos) not in ids:
            ids.append(backend.token_to_id(eos))
    if not ids and backend.token_to_id(EOS_TOKEN) is not None:
        ids.append(backend.token_to_id(EOS_TOKEN))
    return ids


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text.

    Each token maps to a fixed byte string, so we feed bytes into an incremental
    UTF-8 decoder: it returns every complete character at once and holds back an
    incomplete trailing sequence until the next token completes it. Work per token
    is proportional to that token's bytes, never to the length of the sequence.
    """

    def __init__(self, token_bytes: Sequence[bytes]):
        self._token_bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._pieces: list[str] = []

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes ('' if none, or if the id is not in the vocabulary)."""
        i = operator.index(token_id)
        if not 0 <= i < len(self._token_bytes):
            return ""
        return self._emit(self._utf8.decode(self._token_bytes[i]))

    def flush(self) -> str:
        """End of stream: return any held-back bytes, rendered as U+FFFD like decode() does."""
        return self._emit(self._utf8.decode(b"", final=True))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def _emit(self, piece: str) -> str:
        if piece:
            self._pieces.append(piece)
        return piece
