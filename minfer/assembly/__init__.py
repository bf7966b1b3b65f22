"""The assembly: the one place the engine's core meets its features.

- prepare.py: a loaded model made ready to run (quantized, packed for the CPU) and its attention backend;
- selector.py: which attention backend a device and dtype get;
- llm.py: `LLM`, offline generation.
"""
