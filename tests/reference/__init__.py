"""Slow, independent references the engine is checked against (tests/reference/h2o_masked.py)."""
