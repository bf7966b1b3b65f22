"""TextStream: one request's generated text, built token by token, cut at a stop string, streamed in pieces.

The engine works on token ids; this is where they become text. Each generated token goes through the
request's incremental detokenizer (tokenizer.py); the text is searched for the request's stop strings, and
cut before the first one found. `pop_new_text` hands out what was added since the last call, holding back a
tail that could still turn out to be the start of a stop string.
"""

from __future__ import annotations

from .tokenizer import IncrementalDetokenizer


class TextStream:
    def __init__(self, detokenizer: IncrementalDetokenizer, stop: list[str] | None = None, include_stop: bool = False):
        self.detokenizer = detokenizer
        self.stop = stop or []
        self.include_stop = include_stop  # cut after the stop string, not before (include_stop_str_in_output)
        self.text = ""
        self.num_streamed_chars = 0  # how much of `text` pop_new_text has handed out
        self.hit_stop = False  # a stop string was found: the text is final

    def add_token(self, token_id: int, check_stop: bool = True) -> bool:
        """Add one generated token's text. True if it completed a stop string (the text is cut before it).
        check_stop=False adds the text without looking for stop strings (min_tokens not yet reached)."""
        return self._add_text(self.detokenizer.add(token_id), check_stop)

    def flush(self, check_stop: bool = True) -> bool:
        """End of generation: add an unfinished UTF-8 tail, as decode() renders it. True on a stop string."""
        return self._add_text(self.detokenizer.flush(), check_stop)

    def _add_text(self, piece: str, check_stop: bool = True) -> bool:
        if not piece or self.hit_stop:
            return False
        self.text += piece
        if self.stop and check_stop:
            self._cut_at_stop(len(piece))
        return self.hit_stop

    def _cut_at_stop(self, num_new_chars: int) -> None:
        """Cut the text at the first stop string that ends in its last num_new_chars, as vLLM's
        check_stop_strings does: one wholly before them was found already, or was made before min_tokens,
        when stop strings do not count (and may have been streamed)."""
        end = len(self.text) - num_new_chars + 1  # s found at end - len(s) or later ends in the new chars
        hits = [(i, len(s)) for i, s in ((self.text.find(s, max(0, end - len(s))), s) for s in self.stop) if i >= 0]
        if hits:
            start, length = min(hits)  # the stop string that starts first
            self.text = self.text[: start + length if self.include_stop else start]  # and all after it
            self.hit_stop = True

    def pop_new_text(self, finished: bool) -> str:
        """Text added since the last call; while not finished, minus a tail that might become a stop string."""
        end = len(self.text) if finished or not self.stop else self._stable_length()
        piece = self.text[self.num_streamed_chars : end]
        self.num_streamed_chars = max(self.num_streamed_chars, end)
        return piece

    def _stable_length(self) -> int:
        """How much of `text` can no longer change: hold back a tail that could still become a stop
        string (it would have to be cut)."""
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), held, -1):
                if self.text.endswith(stop[:k]):
                    held = k
                    break
        return len(self.text) - held
