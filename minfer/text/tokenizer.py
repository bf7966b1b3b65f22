"""The tokenizer: text to ids, ids to text, and generated ids to text one token at a time.

The `tokenizers` library does the work for every kind of tokenizer a checkpoint ships (byte-level BPE
like GPT-2's, SentencePiece-style like Llama 2's, ...): encoding, decoding, and streaming with its
DecodeStream. What minfer adds: loading from a checkpoint directory (tokenizer_files.py), the ids that
end a generation, each token's bytes (token_bytes.py), and a streaming decoder whose text is always
exactly what decode() gives for the same ids.
"""

from __future__ import annotations

import itertools
import operator
from pathlib import Path
from typing import Iterable

import tokenizers
from tokenizers.decoders import DecodeStream

from .token_bytes import byte_fallback_ids, token_bytes_table
from .tokenizer_files import find_eos_ids, read_backend


def is_text(s: str) -> bool:
    """Whether a str is Unicode text: no lone UTF-16 surrogate (which JSON may escape, and no tokenizer takes)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


class Tokenizer:
    """A checkpoint's tokenizer, wrapping a `tokenizers.Tokenizer`."""

    def __init__(self, backend: tokenizers.Tokenizer, eos_token_id: int | list[int] | None = None):
        self.backend = backend
        # Every id that ends a generation (chat models name several: end of text, end of turn).
        ids = eos_token_id if isinstance(eos_token_id, list) else [eos_token_id]
        self.eos_token_ids: list[int] = [i for i in ids if i is not None]
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._byte_ids = byte_fallback_ids(backend)
        self._token_bytes: list[bytes] | None = None
        self._drops_first_space: bool | None = None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "Tokenizer":
        """Load tokenizer.json, or else vocab.json + merges.txt, from a checkpoint directory."""
        backend = read_backend(model_dir)
        return cls(backend, find_eos_ids(model_dir, backend))

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
    def byte_fallback_ids(self) -> frozenset[int]:
        """The ids of the byte tokens <0x00>..<0xFF> a SentencePiece-style decoder turns back into bytes, else none."""
        return self._byte_ids

    @property
    def token_bytes(self) -> list[bytes]:
        """token_bytes[id] is the bytes that token adds to decoded text (b'' for specials). Built on first use."""
        if self._token_bytes is None:
            self._token_bytes = token_bytes_table(self.backend)
        return self._token_bytes

    def text_bytes(self, token_id: int) -> bytes:
        """token_bytes[id], and b'' for an id past the vocabulary: a padded embedding's row (Qwen3 has 267),
        which the model may sample or rank in its top logprobs, and which decode() skips."""
        table = self.token_bytes
        return table[token_id] if 0 <= token_id < len(table) else b""

    def shown_bytes(self, token_id: int) -> bytes:
        """The bytes a token shows where special tokens are shown: its own, or a special token's name."""
        return self.text_bytes(token_id) or (self.id_to_token(token_id) or "").encode()

    # ---- encode / decode -----------------------------------------------------------

    def encode(self, text: str) -> list[int]:
        """The text's ids, nothing added (special tokens written in the text are still one id each)."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """A prompt as the model was trained to see one: with what the checkpoint's post-processor
        adds around it, such as Llama's <s> or <|begin_of_text|>. GPT-2 and Qwen3 add nothing. (A chat
        template writes these tokens itself, so rendered chats go through encode.)"""
        return self.backend.encode(text, add_special_tokens=True).ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text for `ids`, skipping special tokens and ids outside the vocabulary.

        Invalid UTF-8 (e.g. a sequence cut mid-character) renders as U+FFFD."""
        n = self.vocab_size
        valid = [i for i in map(operator.index, ids) if 0 <= i < n]
        return self.backend.decode(valid, skip_special_tokens=True)

    def detokenizer(self, skip_special_tokens: bool = True, context: list[int] = ()) -> "IncrementalDetokenizer":
        """A streaming decoder; with skip_special_tokens=False special tokens render as their text. `context`,
        the ids before the first one it is fed (a prompt's), is read for how that one begins: a
        SentencePiece decoder drops the space of a text's first token, not of a continuation's."""
        skipped = self._special_ids if skip_special_tokens else frozenset()
        return IncrementalDetokenizer(self.backend, self.vocab_size, skipped, self._byte_ids, context)

    def starts_text(self, context: list[int], skip_special_tokens: bool = True) -> bool:
        """Whether text generated after `context` is, to its detokenizer, the start of a text (nothing it shows
        before it, as after a lone BOS): there a SentencePiece decoder drops the first space (drops_first_space)."""
        skipped = self._special_ids if skip_special_tokens else frozenset()
        return not context_window(self.backend, self.vocab_size, skipped, self._byte_ids, context)

    @property
    def drops_first_space(self) -> bool:
        """Whether decode() drops a text's leading space, as Llama 2's decoder does (`▁Hi` alone is 'Hi')."""
        if self._drops_first_space is None:
            spaced = next((i for i, data in enumerate(self.token_bytes)
                           if data[:1] == b" " and len(data) > 1 and i not in self._byte_ids), None)
            self._drops_first_space = spaced is not None and not self.decode([spaced]).startswith(" ")
        return self._drops_first_space


CONTEXT_IDS = 6  # context a continuation's text is measured after: more than a character's bytes (4)


def context_window(backend: tokenizers.Tokenizer, vocab_size: int, skipped: frozenset[int], byte_ids: frozenset[int],
                   context: list[int]) -> list[int]:
    """The context's last few ids, as a stream would have seen them: a continuation's text is measured after them
    (none: it starts a text, as after a lone BOS). Its trailing byte tokens are left out (decode() renders a run of
    them together with the bytes fed next, which would rewrite the context's text), and so is a context that ends
    mid-character. Where that leaves nothing of a context with text, a stand-in takes its place: the continuation
    still continues a text (a SentencePiece decoder keeps its first space)."""
    kept = (i for i in reversed(context) if 0 <= i < vocab_size and i not in skipped)  # from the end: a long
    window = list(itertools.islice(kept, CONTEXT_IDS))[::-1]  # prompt is not walked whole
    has_text = bool(window)
    while window and window[-1] in byte_ids:
        window.pop()
    if window and backend.decode(window, skip_special_tokens=False).endswith("\ufffd"):
        window = []
    if has_text and not window:
        window = text_stand_in(backend, vocab_size, skipped, byte_ids)
    return window


def text_stand_in(backend: tokenizers.Tokenizer, vocab_size: int, skipped: frozenset[int],
                  byte_ids: frozenset[int]) -> list[int]:
    """One id with visible text of its own (a word, a '!'), not a byte token that bytes fed next would join: a
    continuation measured after it is measured as after any text. None in a vocabulary without one."""
    for i in range(vocab_size):  # the first few ids are specials and bytes, then one soon qualifies
        if i not in skipped and i not in byte_ids:
            text = backend.decode([i], skip_special_tokens=False)
            if text.strip() and "\ufffd" not in text:
                return [i]
    return []


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text: all of it together is what decode() gives.

    `tokenizers`' DecodeStream decodes a short window of recent ids and hands out what the newest one
    added, holding text back while it ends mid-character (U+FFFD) until a later token completes it; work
    per token does not grow with the sequence. Two things are done here. Skipped ids (the special tokens)
    never reach it, as they never reach decode()'s decoder. And a run of byte-fallback tokens
    (<0xE6><0x97><0xA5>) is held whole until a token that is not a byte ends it: decode() renders a run
    holding any invalid byte as one U+FFFD per byte, so no part of a run is final before its end.
    """

    def __init__(self, backend: tokenizers.Tokenizer, vocab_size: int, skipped: frozenset[int] = frozenset(),
                 byte_ids: frozenset[int] = frozenset(), context: list[int] = ()):
        self._backend = backend
        self._vocab_size = vocab_size
        self._skipped = skipped
        self._byte_ids = byte_ids
        window = context_window(backend, vocab_size, skipped, byte_ids, context)  # the text is measured after it
        self._stream = DecodeStream(ids=window or None, skip_special_tokens=False)  # what is skipped never reaches it
        self._run: list[int] = []  # byte tokens whose run has not ended
        self._held: list[int] = []  # ids the stream took without handing out their text yet
        self._window: list[int] = window  # the ids of its last text: the stream measures the next text from them
        self._pieces: list[str] = []

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes ('' if none, or if the id is not in the vocabulary)."""
        i = operator.index(token_id)
        if not 0 <= i < self._vocab_size or i in self._skipped:
            return ""
        if i in self._byte_ids:
            self._run.append(i)
            return ""
        if self._run:  # the run ends: its bytes go in with this token
            ids, self._run = [*self._run, i], []
            piece = self._stream.step(self._backend, ids)
        else:  # one id goes in as an int: a list costs the binding a microsecond more
            ids, piece = [i], self._stream.step(self._backend, i)
        if piece is None:
            self._held += ids
            return ""
        if self._held:
            ids, self._held = self._held + ids, []
        self._window = ids
        return self._emit(piece)

    def flush(self) -> str:
        """End of stream: the text of whatever is held, as decode() renders it (U+FFFD for bytes that never
        made a character), measured from the last window as the stream measures each step."""
        tail, self._held, self._run = self._held + self._run, [], []
        if not tail:
            return ""
        before = self._backend.decode(self._window, skip_special_tokens=False)
        after = self._backend.decode(self._window + tail, skip_special_tokens=False)
        return self._emit(after[len(before) :])

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
