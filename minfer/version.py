"""minfer's version: one place, importable from every layer (the HTTP server names it in its headers)."""

__version__ = "0.1.0"
