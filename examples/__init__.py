"""Runnable examples (python examples/<name>/...; not part of the installed package)."""
