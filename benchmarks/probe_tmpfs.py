"""What a memory level's write costs the kernel: one checkpoint's bytes (default 1.17 GB, the 100M
GPT's) written to /dev/shm in 8 MiB ``pwrite`` calls, into a fresh file (reserved with fallocate or
not, after unlinking the previous one, as retention does) and over an existing file's pages.

    python -m benchmarks.probe_tmpfs [--bytes N] [--rounds 3] [--dir /dev/shm]

Prints wall and CPU seconds of the writing thread per case and round (and the unlink's).
"""

from __future__ import annotations

import argparse
import os
import resource
import time

import torch

PIECE = 8 << 20


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_THREAD)
    return r.ru_utime + r.ru_stime


def _write(path: str, data: memoryview, reserve: bool) -> tuple[float, float]:
    t, c = time.perf_counter(), _cpu()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        if reserve:
            os.posix_fallocate(fd, 0, len(data))
        for off in range(0, len(data), PIECE):
            os.pwrite(fd, data[off : off + PIECE], off)
    finally:
        os.close(fd)
    return time.perf_counter() - t, _cpu() - c


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_tmpfs", description=__doc__)
    p.add_argument("--bytes", type=int, default=1_172_847_184)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default="/dev/shm")
    args = p.parse_args(argv)
    src = torch.full((args.bytes,), 7, dtype=torch.uint8)
    data = memoryview(src.numpy())
    folder = os.path.join(args.dir, f"lazyckpt-probe-{os.getpid()}")
    os.makedirs(folder)
    path = os.path.join(folder, "f")
    try:
        for rnd in range(args.rounds):
            for case in ("fresh+fallocate", "fresh", "overwrite"):
                unlink = (0.0, 0.0)
                if case != "overwrite" and os.path.exists(path):
                    t, c = time.perf_counter(), _cpu()
                    os.unlink(path)
                    unlink = (time.perf_counter() - t, _cpu() - c)
                wall, cpu = _write(path, data, case == "fresh+fallocate")
                print(f"round {rnd} {case:16s} wall {wall:.3f} s  cpu {cpu:.3f} s  (unlink before: {unlink[0]:.3f} s)")
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(folder)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
