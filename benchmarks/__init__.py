"""Benchmarks of dflash_train: each runs from the repo root as `python -m benchmarks.NAME`."""
