"""Exercises: stubs to fill in, each graded by its stage's script (tutorials/README.md says how)."""
