"""Runnable examples; run them from the repository root as modules (``python -m examples.train_plain``)."""
