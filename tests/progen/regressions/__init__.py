"""Shrunk generated programs that once failed an invariant (tests/test_generated.py)."""
