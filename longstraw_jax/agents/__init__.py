"""Agent branches' environments, called from the host (docs/architecture.md 11): the token-level protocol and its
calls (agents/environment.py), text environments and --tools (agents/text.py)."""
