"""What the disk level's copy costs the training: a tmpfs file of one checkpoint's size (default
1.17 GB, the 100M GPT's) copied to a disk folder in the background while the GPT trains, against
the same training with no copy, and the ways that copy could be made.

    python -m benchmarks.probe_copy --size 100m --threads 1 --rounds 4 --dst /tmp   # ~10 min

One model trains throughout; blocks of ``--block`` steps take turns (order reversed every other
round); a copying block starts one copy at its first step, as the disk level does once every 10
steps. Per mode and round: the block's extra time per step against the same round's no-copy block,
the copy's wall and CPU seconds (its thread's), and the host's iowait/steal during the block.

Modes: ``none``; ``lazyckpt`` (``schedule._copy.copy_file``: a read-only mapping of the source written
with O_DIRECT, what the disk level runs); ``bounce`` (``preadv`` into an aligned buffer, O_DIRECT);
``sendfile`` (the kernel copies through the page cache; fsync); ``populate`` (the whole source mapped
with MAP_POPULATE, O_DIRECT).
"""

from __future__ import annotations

import argparse
import contextlib
import mmap
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import torch

from lazyckpt.schedule import _copy
from lazyckpt.storage import fs as _fs

from . import gpt as _gpt

_CHUNK = 16 << 20


def _write(fd: int, dfd: int, piece: memoryview, off: int) -> None:
    """``piece`` at ``off``: its whole pages through the O_DIRECT descriptor ``dfd`` (if any), the rest buffered."""
    whole = len(piece) - len(piece) % mmap.PAGESIZE if dfd >= 0 else 0
    if whole:
        _fs.pwrite_all(dfd, piece[:whole], off)
    if whole < len(piece):
        _fs.pwrite_all(fd, piece[whole:], off + whole)


@contextlib.contextmanager
def _files(src: str, dst: str) -> Iterator[tuple[int, int, int, int]]:
    """(source fd, its size, destination fd, O_DIRECT destination fd or -1), all closed afterwards."""
    fd_in = os.open(src, os.O_RDONLY)
    fds = [fd_in]
    try:
        size = os.fstat(fd_in).st_size
        fds.append(_fs.open_temporary(dst, size))
        fds.append(_fs.open_direct(dst))
        yield fd_in, size, fds[1], fds[2]
        os.fsync(fds[1])
    finally:
        for fd in fds:
            if fd >= 0:
                os.close(fd)


def _bounce(src: str, dst: str) -> None:
    with _files(src, dst) as (fd_in, size, fd, dfd), mmap.mmap(-1, _CHUNK) as buf, memoryview(buf) as view:
        for off in range(0, size, _CHUNK):
            n = min(_CHUNK, size - off)
            os.preadv(fd_in, [view[:n]], off)
            _write(fd, dfd, view[:n], off)


def _sendfile(src: str, dst: str) -> None:
    fd_in = os.open(src, os.O_RDONLY)
    size = os.fstat(fd_in).st_size
    fd = _fs.open_temporary(dst, size)
    try:
        off = 0
        while off < size:
            off += os.sendfile(fd, fd_in, off, min(64 << 20, size - off))
        os.fsync(fd)
    finally:
        os.close(fd)
        os.close(fd_in)


def _populate(src: str, dst: str) -> None:
    flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
    with (
        _files(src, dst) as (fd_in, size, fd, dfd),
        mmap.mmap(fd_in, size, flags=flags, prot=mmap.PROT_READ) as whole,
        memoryview(whole) as view,
    ):
        for off in range(0, size, _CHUNK):
            _write(fd, dfd, view[off : off + min(_CHUNK, size - off)], off)


COPIES: dict[str, Callable[[str, str], None] | None] = {
    "none": None,
    "lazyckpt": lambda src, dst: _copy.copy_file(src, dst, fsync=True),
    "bounce": _bounce,
    "sendfile": _sendfile,
    "populate": _populate,
}


def _host_ticks() -> list[int]:
    with open("/proc/stat") as fh:
        return [int(x) for x in fh.readline().split()[1:]]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.probe_copy", description=__doc__)
    p.add_argument("--size", default="100m", help="tiny | small | 100m (benchmarks/gpt.py)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: a core to spare)")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--block", type=int, default=10, help="steps per block (one copy per copying block)")
    p.add_argument("--bytes", type=int, default=1_170_000_000, help="the copied file's size")
    p.add_argument("--modes", default=",".join(COPIES), help="from " + ",".join(COPIES) + "; none is always run")
    p.add_argument("--src", default="/dev/shm", help="memory folder of the source file")
    p.add_argument("--dst", default=".", help="disk folder the copies go to")
    args = p.parse_args(argv)
    modes = ["none", *[m for m in args.modes.split(",") if m and m != "none"]]
    if unknown := [m for m in modes if m not in COPIES]:
        p.error(f"unknown modes {unknown}")
    torch.set_num_threads(args.threads)
    src_dir = tempfile.mkdtemp(prefix="lazyckpt-probe-copy-", dir=args.src)
    dst_dir = tempfile.mkdtemp(prefix="lazyckpt-probe-copy-", dir=args.dst)
    try:
        src = os.path.join(src_dir, "src.bin")
        with open(src, "wb") as fh:
            block = os.urandom(min(_CHUNK, args.bytes))
            for off in range(0, args.bytes, len(block)):
                fh.write(block[: min(len(block), args.bytes - off)])
        _run(args, modes, src, dst_dir)
    finally:
        shutil.rmtree(src_dir, ignore_errors=True)
        shutil.rmtree(dst_dir, ignore_errors=True)
    return 0


def _run(args: argparse.Namespace, modes: list[str], src: str, dst_dir: str) -> None:
    cfg = _gpt.config_for(args.size)
    model, tick = _gpt.build(cfg, seed=0), os.sysconf("SC_CLK_TCK")
    opt = _gpt.make_optimizer(model)
    batches = iter(_gpt.BatchStream(cfg, seed=0))
    for _ in range(2):
        _gpt.train_step(model, opt, next(batches))
    print(f"probe_copy: {args.size} GPT, {args.threads} torch thread(s), {args.bytes / 1e9:.2f} GB copied "
          f"to {dst_dir} at the first of every {args.block} steps", flush=True)  # fmt: skip
    totals: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            copy, info = COPIES[mode], dict[str, float]()
            dst = os.path.join(dst_dir, f"{mode}-{r}.bin")
            _gpt.train_step(model, opt, next(batches))  # the switch
            before, t0, thread = _host_ticks(), time.perf_counter(), None
            for i in range(args.block):
                if i == 0 and copy is not None:
                    thread = threading.Thread(target=_timed, args=(copy, src, dst, info), name="probe-copy")
                    thread.start()
                _gpt.train_step(model, opt, next(batches))
            totals[mode].append(time.perf_counter() - t0)
            if thread is not None:
                thread.join()
            ticks = [b - a for a, b in zip(before, _host_ticks(), strict=False)]
            if copy is not None:
                if "copy" not in info or os.path.getsize(dst) != args.bytes:
                    raise RuntimeError(f"{mode}: the copy failed or is not {args.bytes} bytes (see above)")
                os.unlink(dst)
            extra = "".join(f" {k} {v:.3f} s" for k, v in info.items())
            print(f"round {r} {mode:9s} block {totals[mode][-1]:7.3f} s{extra}  host iowait {ticks[4] / tick:.2f} s"
                  f" steal {ticks[7] / tick if len(ticks) > 7 else 0:.2f} s", flush=True)  # fmt: skip
    print("extra per step against the same round's no-copy block:")
    for mode in modes[1:]:
        diffs = [(a - b) / args.block for a, b in zip(totals[mode], totals["none"], strict=True)]
        rounds = " ".join(f"{d:+.3f}" for d in diffs)
        print(f"  {mode:9s} median {statistics.median(diffs):+.4f} s  (rounds {rounds})")


def _timed(copy: Callable[[str, str], None], src: str, dst: str, info: dict[str, float]) -> None:
    t, cpu = time.perf_counter(), time.thread_time()
    copy(src, dst)
    info["copy"], info["copy_cpu"] = time.perf_counter() - t, time.thread_time() - cpu


if __name__ == "__main__":
    raise SystemExit(main())
