"""Benchmarks and the repository's one GPT model (``benchmarks.gpt``); not part of the lazyckpt wheel.

Run from the repository root, as modules, so that ``benchmarks`` (and ``examples``) import without
any ``sys.path`` changes::

    python -m benchmarks.bench_core --size 100m          # or: lazyckpt bench --size 100m (same thing)
    python -m benchmarks.bench_lightning --steps 16 --repeats 4
    python -m benchmarks.bench_accelerate --size 100m --rounds 4 --steps 10
"""
