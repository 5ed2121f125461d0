"""transformers Trainer: the wall time of a whole ``train()`` that saves every step, stock vs lazyckpt, in one run.

    python -m benchmarks.bench_transformers_run                      # 24 steps, save_steps=1, 5 rounds
    python -m benchmarks.bench_transformers_run --out benchmarks/results/transformers-run.json

The tiny GPT-2 of the test suite (2 layers, 32 wide) trains ``--steps`` steps with ``save_steps=1`` into a
fresh folder on disk, ``train()`` timed from its call to its return (lazy: the end of ``train()`` waits for
every checkpoint to be committed). Modes, interleaved ``--rounds`` times, each in this process:

* ``stock``          the Trainer's own saving (synchronous writes, no fsync)
* ``lazy``           ``lazyckpt.transformers.install(trainer)``: durable (each file and folder fsynced once)
* ``lazy-nofsync``   the same with ``fsync=False`` (a crash may lose the newest checkpoint, never expose a
  partial one)
* ``fsync-floor``    stock, then one ``sync``-equivalent: fsync of every file and folder it wrote (what
  durability costs this disk for these bytes, done serially after the run)

Prints the median per mode and the ratio to stock; ``--out`` writes them as JSON with the machine and versions.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time

import torch
import transformers
from tests.transformers_scripts import tiny

import lazyckpt
import lazyckpt.transformers

MODES = ("stock", "lazy", "lazy-nofsync", "fsync-floor")


def one(mode: str, out: str, steps: int) -> float:
    shutil.rmtree(out, ignore_errors=True)
    tr = tiny.trainer(out, max_steps=steps, save_steps=1, logging_steps=10_000)
    handle = None
    if mode.startswith("lazy"):
        handle = lazyckpt.transformers.install(tr, fsync=mode == "lazy")
    t0 = time.perf_counter()
    tr.train()
    if mode == "fsync-floor":
        for root, _dirs, files in os.walk(out):
            for name in files:
                fd = os.open(os.path.join(root, name), os.O_RDONLY)
                os.fsync(fd)
                os.close(fd)
            fd = os.open(root, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    wall = time.perf_counter() - t0
    if handle is not None:
        handle.uninstall()
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", default="default", help="torch threads: 1 (a spare core) or default")
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder on disk)")
    ap.add_argument("--out", default=None, help="write the result as JSON here")
    a = ap.parse_args()
    if a.threads != "default":
        torch.set_num_threads(int(a.threads))
    base = a.dir or tempfile.mkdtemp(prefix="lazyckpt-bench-tr-", dir=os.path.expanduser("~"))
    times: dict[str, list[float]] = {m: [] for m in MODES}
    one("stock", os.path.join(base, "warm"), 2)  # imports, first-call costs
    for _ in range(a.rounds):
        for mode in MODES:
            times[mode].append(one(mode, os.path.join(base, mode), a.steps))
    shutil.rmtree(base, ignore_errors=True)
    med = {m: statistics.median(v) for m, v in times.items()}
    print(f"train() of {a.steps} steps, save_steps=1, torch threads {torch.get_num_threads()}, median of {a.rounds}:")
    for m in MODES:
        print(f"  {m:14s} {med[m]:7.3f} s   {med[m] / med['stock']:5.2f}x stock   (min {min(times[m]):.3f})")
    if a.out:
        result = {
            "command": "python -m benchmarks.bench_transformers_run " + " ".join(sys.argv[1:]),
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                         "lazyckpt": lazyckpt.__version__},  # fmt: skip
            "steps": a.steps, "rounds": a.rounds, "torch_threads": torch.get_num_threads(),
            "seconds": times, "median_s": med, "ratio_to_stock": {m: med[m] / med["stock"] for m in MODES},
        }  # fmt: skip
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
