"""The n-gram proposer (prompt lookup): guess that the text repeats itself.

Take the sequence's last n tokens (its prompt and output so far), find where they occurred before in
the same sequence, and propose the k tokens that followed there. Longer suffixes are tried first
(ngram_max down to ngram_min): a longer match is a better predictor. Among matches of one length the
most recent wins (the nearest context is the likeliest to continue alike). It costs no model at all,
and it is right exactly where copying is: editing, extraction, code, summaries quoting their source.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found
        (of ngram_max down to ngram_min tokens); [] when no suffix occurred before."""
        L = len(token_ids)
        if k < 1 or L <= self.ngram_min:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)  # (L,)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            suffix = tokens[L - n :]  # (n,)
            # Windows starting at 0 .. L - n - 1: each is followed by at least one token, and none is
            # the suffix itself.
            windows = np.lib.stride_tricks.sliding_window_view(tokens[: L - 1], n)  # (L - n, n)
            hits = np.flatnonzero((windows == suffix).all(axis=1))
            if hits.size:
                follow = int(hits[-1]) + n  # the first token after the latest earlier match
                return token_ids[follow : follow + k]
        return []
