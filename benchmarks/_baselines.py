"""What ``benchmarks.bench_core`` compares the modes against: raw disk writes, CRC32 speed, raw D2H copies."""

from __future__ import annotations

import os
import platform
import time
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lazyckpt.cli._probe import filesystem_of as _filesystem_of
from lazyckpt.storage.fs import fsync_dir

GB = 1e9


def make_payload(nbytes: int) -> torch.Tensor:
    """A warm (touched) host buffer of incompressible bytes, allocated once."""
    buf = torch.empty(nbytes, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(1)
    block = torch.randint(0, 256, (min(nbytes, 64 << 20),), dtype=torch.uint8, generator=gen)
    for off in range(0, nbytes, block.numel()):
        n = min(block.numel(), nbytes - off)
        buf[off : off + n].copy_(block[:n])
    return buf


def raw_write(payload: torch.Tensor, path: Path, chunk: int = 64 << 20) -> tuple[float, float]:
    """Sequential write of the payload with one thread, fsync, close: (seconds, CPU seconds)."""
    mv = memoryview(payload.numpy()).cast("B")  # type: ignore[arg-type]
    t, c = time.perf_counter(), time.process_time()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        off = 0
        while off < len(mv):
            off += os.write(fd, mv[off : off + chunk])
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(str(path.parent))
    dt, dc = time.perf_counter() - t, time.process_time() - c
    os.unlink(path)
    return dt, dc


def storage_floor(disk_s: float, step_s: float, checkpoints: int) -> float:
    """The least stall per checkpoint any checkpointer pays for one checkpoint after each of
    ``checkpoints`` steps, final drain included, when the disk (``disk_s`` to write and fsync one
    checkpoint's bytes) is the only limit and writing costs the training no CPU: the last write
    starts after the last step (``disk_s`` once per run), and every other write that outlasts a step
    (``step_s`` without checkpointing) delays the next one. Splits into ``one_time_drain_s / checkpoints``
    + ``per_checkpoint_s`` (see ``floor_parts``)."""
    one_time, per_ckpt = floor_parts(disk_s, step_s, checkpoints)
    return one_time / checkpoints + per_ckpt


def floor_parts(disk_s: float, step_s: float, checkpoints: int) -> tuple[float, float]:
    """(the final drain's share: ``disk_s`` once per run, the per-checkpoint part: the disk time a
    step cannot hide, ``(n - 1) / n * max(0, disk_s - step_s)``)."""
    n = max(1, checkpoints)
    return disk_s, (n - 1) / n * max(0.0, disk_s - step_s)


def disk_write_s(directory: Path, nbytes: int, reps: int = 3) -> dict[str, Any]:
    """The disk's own time to write ``nbytes`` sequentially (one thread, buffered) and fsync them in
    ``directory``: median of ``reps``, with every run and the filesystem."""
    payload = make_payload(nbytes)
    runs = [raw_write(payload, directory / ".lazyckpt-bench-raw.bin")[0] for _ in range(reps)]
    del payload
    med = sorted(runs)[len(runs) // 2]
    return {"bytes": nbytes, "s": med, "gbps": nbytes / med / GB, "runs": runs,
            "filesystem": filesystem_of(directory)}  # fmt: skip


def crc_throughput(payload: torch.Tensor, nbytes: int = 256 << 20, reps: int = 3) -> dict[str, Any]:
    """GB/s of zlib's and ISA-L's CRC32 over the same bytes, and which one lazyckpt uses."""
    from lazyckpt.formats.crc import CRC_IMPL

    mv = memoryview(payload.numpy()).cast("B")[: min(nbytes, payload.numel())]  # type: ignore[arg-type]
    out: dict[str, Any] = {"bytes": len(mv), "isal": None, "lazyckpt_backend": CRC_IMPL}
    impls: dict[str, Any] = {"zlib": zlib.crc32}
    try:
        from isal import isal_zlib

        impls["isal"] = isal_zlib.crc32
    except ImportError:
        pass
    for name, fn in impls.items():
        best = float("inf")
        for _ in range(reps):
            t = time.perf_counter()
            fn(mv)
            best = min(best, time.perf_counter() - t)
        out[name] = len(mv) / best / GB
    return out


def raw_d2h(tensors: list[torch.Tensor], reps: int = 3) -> dict[str, Any]:
    """Device-to-host copy of the tensors into one pinned buffer on a side stream, best of ``reps``."""
    total = sum(t.numel() * t.element_size() for t in tensors)
    host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    stream = torch.cuda.Stream()
    views, off = [], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        views.append((host[off : off + n], t))
        off += n
    times = []
    for i in range(reps + 1):  # the first is a warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            for dst, src in views:
                dst.copy_(src.detach().reshape(-1).view(torch.uint8), non_blocking=True)
        stream.synchronize()
        if i:
            times.append(time.perf_counter() - t0)
    return {"bytes": total, "s": min(times), "gbps": total / min(times) / GB}


def _tensors(obj: Any) -> Iterator[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def distinct_tensors(obj: Any) -> list[torch.Tensor]:
    """One tensor per storage (tied weights appear twice in a state dict)."""
    seen, out = set(), []
    for t in _tensors(obj):
        key = (t.untyped_storage().data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            out.append(t)
    return out


def cpu_pressure_total() -> float | None:
    """Cumulative microseconds some task waited for a CPU (Linux PSI), None when unavailable."""
    try:
        line = Path("/proc/pressure/cpu").read_text().splitlines()[0]
        return float(line.rsplit("total=", 1)[1])
    except (OSError, IndexError, ValueError):
        return None


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "?"


def filesystem_of(path: Path) -> str:
    return _filesystem_of(str(path))
