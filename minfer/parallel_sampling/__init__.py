"""Parallel sampling: n completions of one prompt, computed once and stored once (forks.py).
docs/sampling.md and tutorial 16 tell the story."""
