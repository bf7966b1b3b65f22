"""Speculative decoding: propose a few tokens cheaply, verify them all in one forward of the target model.

- ngram.py: the n-gram (prompt lookup) proposer;
- verify.py: the acceptance rule (greedy: the longest matching prefix; sampling: rejection sampling,
  exact in distribution) over the k + 1 rows a speculating sequence contributes to a step;
- speculator.py: when a request speculates (from its own recent acceptance), and the counters.

docs/speculative.md tells the whole story.
"""

from .speculator import SpecStats, Speculator

__all__ = ["SpecStats", "Speculator"]
