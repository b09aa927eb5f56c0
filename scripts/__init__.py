"""Maintenance scripts: those that import the repo run from its root as `python -m scripts.NAME`."""
