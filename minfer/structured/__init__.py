"""Structured outputs: a request's JSON schema, regex, choice or grammar held as a token mask per step.

- grammars.py: a request's constraint compiled by llguidance (imported only when a request asks), and
  the compiled grammars kept for reuse;
- masks.py: one step's masks, filled on a thread while the forward runs, applied to the sampled rows;
- structured.py: the room's face to the engine: which sequences hold a matcher, and what each step's
  tokens do to it (a grammar that completes ends its request).

docs/structured_outputs.md tells the whole story; tutorial 19 shows it step by step.
"""
