"""Runnable examples and training scripts: run each from the repository root as ``python -m examples.NAME``."""
