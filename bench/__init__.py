"""Benchmarks of the model layer on the shared dev photos.

Run from the repository root: `python -m bench.accuracy`, `python -m bench.speed`.
"""
