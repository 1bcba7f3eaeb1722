"""Tools a completion may call while it reasons: a sandboxed Python executor (sandbox.py)."""
