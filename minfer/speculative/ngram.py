"""The n-gram proposer (prompt lookup): guess that the text repeats itself.

Take the sequence's last n tokens (its prompt and output so far), find where they occurred before in
the same sequence, and propose the k tokens that followed there. Longer suffixes are tried first
(ngram_max down to ngram_min): a longer match is a better predictor. Among matches of one length the
most recent wins (the nearest context is the likeliest to continue alike). It costs no model at all,
and it is right exactly where copying is: editing, extraction, code, summaries quoting their source.

The lookup runs on every decode step of every speculating sequence, so it must cost next to nothing
beside a small model's step: each sequence keeps an index (n-gram -> where it last ended) that grows
by one position per new token, and a lookup is a dictionary probe per n.
"""

from __future__ import annotations

import weakref


class NgramIndex:
    """For each n in ngram_min .. ngram_max: every n-gram of a token list that is followed by at least
    one token, mapped to the position after its latest occurrence."""

    def __init__(self, ngram_min: int, ngram_max: int):
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.follow: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(ngram_min, ngram_max + 1)}
        self.num_indexed = 0  # the n-grams ending before this position are in

    def extend(self, token_ids: list[int]) -> None:
        """Index the n-grams ending at positions num_indexed .. len - 2 (the last token's n-grams are the
        suffixes looked up, followed by nothing yet). token_ids must extend the list indexed so far."""
        for end in range(self.num_indexed, len(token_ids) - 1):
            for n, follow in self.follow.items():
                if end + 1 >= n:
                    follow[tuple(token_ids[end + 1 - n : end + 1])] = end + 1
        self.num_indexed = max(self.num_indexed, len(token_ids) - 1)

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found."""
        L = len(token_ids)
        for n in range(min(self.ngram_max, L - 1), self.ngram_min - 1, -1):
            follow = self.follow[n].get(tuple(token_ids[L - n :]))
            if follow is not None:
                return token_ids[follow : follow + k]
        return []


class NgramProposer:
    def __init__(self, ngram_min: int, ngram_max: int):
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._indexes: weakref.WeakKeyDictionary[object, NgramIndex] = weakref.WeakKeyDictionary()

    def propose(self, token_ids: list[int], k: int, key: object | None = None) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest suffix found
        (of ngram_max down to ngram_min tokens); [] when no suffix occurred before. With a key (the
        sequence; token_ids only ever grows under it), its index is kept and extended between calls."""
        if k < 1 or len(token_ids) <= self.ngram_min:
            return []
        index = self._indexes.get(key) if key is not None else None
        if index is None or index.num_indexed > len(token_ids):
            index = NgramIndex(self.ngram_min, self.ngram_max)
            if key is not None:
                self._indexes[key] = index
        index.extend(token_ids)
        return index.lookup(token_ids, k)
