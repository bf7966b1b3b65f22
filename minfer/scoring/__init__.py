"""Scoring: the model's own logprobs of sampled tokens and of prompt positions, computed in the step that
produced them (logprobs.py). docs/scoring.md tells the whole story."""
