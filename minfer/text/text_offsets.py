"""Where each token's text starts in a decoded text, in characters: what /v1/completions' `text_offset` says.

Counted from the bytes each token adds (Tokenizer.token_bytes), rendered as decode() and the detokenizer
render them (tokenizer.py). A character split over tokens counts once, at its first token. Bytes that make no
character show as U+FFFD: one per broken sequence in a byte-level tokenizer's text (UTF-8 decoding with
replacement), but one per byte for a run of byte-fallback tokens (<0xE6><0x97>) that holds any invalid byte,
even a valid character's bytes in that run. Whether a run is valid is known when it ends (a token that is not
a byte, or the end of the text), so offsets are counted a list of tokens at a time. A SentencePiece decoder
drops a text's first space (`▁Once` starts 'Once'): tokens that start a text count without it.
"""

from __future__ import annotations

import codecs

from .tokenizer import Tokenizer

CONTINUATION_BYTES = bytes(range(0x80, 0xC0))  # a UTF-8 character's bytes after its first


class TextOffsets:
    """Counts one text's token offsets, list after list (a stream's chunks continue each other)."""

    def __init__(self, tokenizer: Tokenizer, specials_shown: bool = False, starts_text: bool = False):
        self.tokenizer = tokenizer
        self.specials_shown = specials_shown  # skip_special_tokens false: their names are in the text
        self.byte_ids = tokenizer.byte_fallback_ids
        self.text_offset = 0  # the characters the tokens counted so far have added
        # The tokens start a text (Tokenizer.starts_text) whose decoder drops its first space: until a token adds
        # bytes, the first of them may be that space.
        self._first_space_dropped = starts_text and tokenizer.drops_first_space
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # byte-level: holds a character's first bytes
        self._run = b""  # byte fallback: the bytes of a run of byte tokens not yet ended

    def resume_at(self, offset: int) -> None:
        """The text so far is `offset` characters long (an echoed prompt's own text): count on from there."""
        self.text_offset, self._run = offset, b""
        self._utf8.reset()

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes the token adds to the text; a special token adds its name where the text shows it."""
        return self.tokenizer.shown_bytes(token_id) if self.specials_shown else self.tokenizer.text_bytes(token_id)

    def offsets(self, token_ids: list[int], final: bool = True) -> list[int]:
        """Each token's offset; `final`: the text ends with them (a run of byte tokens open at the end is
        ended, as decode() renders it), else a run open at the end is counted as far as it is known and
        carried on into the next list."""
        out, valid = [], None  # valid: how the run open here renders, once read ahead (the same for all its tokens)
        for i, token_id in enumerate(token_ids):
            data = self.token_bytes(token_id)
            in_run = token_id in self.byte_ids or (self._run and not data)  # a skipped special does not end a run
            if in_run:
                valid = self._run_valid(token_ids, i, final) if valid is None else valid
            if data and self._first_space_dropped:
                self._first_space_dropped = False
                # the text's first character, if a space: not one of a run rendered as U+FFFDs
                self.text_offset -= data[:1] == b" " and (valid or not in_run)
            if in_run:
                before, self._run = self._run, self._run + data
                out.append(max(0, self._run_position(before, data[0] if data else None, valid)))
            else:
                if self._run:  # any other token ends it (decode() sees it)
                    self._end_run()
                    valid = None
                out.append(max(0, self._advance(data)))  # the dropped space's token starts the text, at 0
        if final and self._run:
            self._end_run()
        return out

    def open_run_start(self, token_ids: list[int]) -> int:
        """Where a run of byte tokens still open at the end of token_ids starts (their length if none): a stream
        sends its tokens once a token that is not a byte ends it, and decode() has shown how it renders."""
        start = len(token_ids)
        for i in range(len(token_ids) - 1, -1, -1):
            if token_ids[i] in self.byte_ids:
                start = i
            elif self.token_bytes(token_ids[i]):  # text: no run reaches back past it (a skipped special may)
                break
        return start

    # ---- byte-level text: UTF-8 with replacement ---------------------------------------

    def _advance(self, data: bytes) -> int:
        held = self._utf8.getstate()[0]
        # held bytes that this token does not continue never became a character: a U+FFFD stands first
        offset = self.text_offset + (bool(held and data) and not _utf8(held + data[:1], final=False))
        self.text_offset += len(self._utf8.decode(data))
        return offset

    # ---- byte fallback: a run renders whole, or as one U+FFFD per byte -------------------

    def _run_valid(self, token_ids: list[int], i: int, final: bool) -> bool:
        """Whether the run open at token_ids[i] renders as characters, as far as the list tells: whole
        characters if it ends in the list (or the list ends the text); if not, bytes characters may complete."""
        ahead, ended = b"", final
        for token_id in token_ids[i:]:
            data = self.token_bytes(token_id)
            if token_id in self.byte_ids:
                ahead += data
            elif data:
                ended = True
                break
        return _utf8(self._run + ahead, final=ended)

    def _run_position(self, before: bytes, byte: int | None, valid: bool) -> int:
        """Where a token after the run's bytes `before` starts: at its own U+FFFD in a run of them, or at the
        character its byte starts or continues (byte None: a token that adds no bytes)."""
        if not valid:
            return self.text_offset + len(before)
        starts = len(before.translate(None, CONTINUATION_BYTES))  # the characters begun before it
        return self.text_offset + starts - (byte is not None and 0x80 <= byte < 0xC0)

    def _end_run(self) -> None:
        run, self._run = self._run, b""
        self.text_offset += len(run.decode()) if _utf8(run, final=True) else len(run)


def _utf8(data: bytes, final: bool) -> bool:
    """Whether data is UTF-8: whole characters if final, else ending, maybe, in a character's first bytes."""
    try:
        codecs.getincrementaldecoder("utf-8")().decode(data, final=final)
    except UnicodeDecodeError:
        return False
    return True
