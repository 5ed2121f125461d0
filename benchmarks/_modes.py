"""The ways of checkpointing that ``benchmarks.bench_core`` compares, each timing itself step by step.

A mode's ``save(state)`` runs after ``optimizer.step()``; ``before_step()`` right before the next
step (peers that must be waited on there, like DCP's staging); ``drain()`` waits until everything
asked for is durable. Every mode records when the training thread was blocked (``blocked``) and
when work ran in the background (``background``), as ``(start, end, what)`` perf_counter spans.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lazyckpt.storage.fs import fsync_dir, pwrite_all

Span = tuple[float, float, str]


@contextlib.contextmanager
def write_in_save(force: bool | None) -> Iterator[None]:
    """For an A/B of lazyckpt's placement rule (``lazyckpt.core.plan.write_in_save``): inside it,
    ``save()`` writes a file on a memory filesystem itself (``force=True``: wherever its tensors are
    on the CPU), always leaves it to the background threads (``False``), or follows the rule (``None``).
    ``SavePlan.decide`` looks the rule up at each save, so patching it there for one mode's
    ``save()`` calls leaves every other mode of the run alone."""
    if force is None:
        yield
        return
    from lazyckpt.core import plan

    rule = plan.write_in_save
    plan.write_in_save = lambda memory, devices, nbytes=0: force and memory and all(d.type == "cpu" for d in devices)
    try:
        yield
    finally:
        plan.write_in_save = rule


class Mode:
    """No checkpoint (the baseline); the base class of the others."""

    name = "none"

    def __init__(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        self.reset_metrics()

    def reset_metrics(self) -> None:
        self.call_s: list[float] = []  # time inside save()
        self.wait_s: list[float] = []  # time waiting elsewhere (before_step, previous upload)
        self.write_gbps: list[float] = []  # per save: bytes / time spent writing
        self.blocked: list[Span] = []
        self.background: list[Span] = []

    def save(self, state: dict[str, Any], nbytes: int) -> None:
        pass

    def before_step(self) -> None:
        pass

    def drain(self) -> None:
        pass

    def close(self) -> None:
        pass

    def metrics(self) -> dict[str, Any]:
        return {"save_call_s": _median(self.call_s), "wait_s_total": sum(self.wait_s),
                "write_gbps": _median(self.write_gbps)}  # fmt: skip

    def _blocked(self, t0: float, t1: float, what: str) -> None:
        self.blocked.append((t0, t1, what))


class TorchSave(Mode):
    """Synchronous torch.save to a temporary file + flush + fsync + atomic rename (what most loops do)."""

    name = "torch.save"

    def __init__(self, out_dir: Path) -> None:
        super().__init__(out_dir)
        self.path, self.tmp = out_dir / "torchsave.pt", out_dir / "torchsave.pt.tmp"

    def save(self, state: dict[str, Any], nbytes: int) -> None:
        t = time.perf_counter()
        with open(self.tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(self.tmp, self.path)
        fsync_dir(str(self.out_dir))
        t1 = time.perf_counter()
        self.call_s.append(t1 - t)
        self.write_gbps.append(nbytes / (t1 - t) / 1e9)
        self._blocked(t, t1, "save")


class DCPAsync(Mode):
    """torch.distributed.checkpoint.async_save(no_dist=True) with a reused DefaultStager.

    Waits on the previous upload before the next save (the staged buffers are reused), on
    ``staging_completion`` right before the next optimizer.step(), on ``upload_completion`` at the end.
    """

    name = "dcp"

    def __init__(self, out_dir: Path, device: torch.device) -> None:
        super().__init__(out_dir)
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        cuda = device.type == "cuda"
        options = StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                 use_non_blocking_copy=cuda)  # fmt: skip
        self.dcp, self.stager = dcp, DefaultStager(options)
        self.dir = out_dir / "dcp"
        self.resp: Any = None

    def save(self, state: dict[str, Any], nbytes: int) -> None:
        t = time.perf_counter()
        if self.resp is not None:  # the stager's cached buffers are about to be overwritten
            self.resp.upload_completion.result()
        t1 = time.perf_counter()
        self.resp = self.dcp.async_save(state, checkpoint_id=str(self.dir), async_stager=self.stager, no_dist=True)
        t2 = time.perf_counter()
        self.wait_s.append(t1 - t)
        self.call_s.append(t2 - t1)
        self._blocked(t, t1, "wait")
        self._blocked(t1, t2, "save")
        self._track(self.resp, t2, nbytes)

    def _track(self, resp: Any, t_issued: float, nbytes: int) -> None:
        marks: dict[str, float] = {}

        def staged(_f: Any) -> None:
            marks["staged"] = time.perf_counter()
            self.background.append((t_issued, marks["staged"], "stage"))

        def uploaded(_f: Any) -> None:
            end = time.perf_counter()
            start = marks.get("staged", t_issued)
            self.background.append((start, end, "write"))
            self.write_gbps.append(nbytes / max(end - start, 1e-9) / 1e9)

        resp.staging_completion.add_done_callback(staged)
        resp.upload_completion.add_done_callback(uploaded)

    def before_step(self) -> None:
        if self.resp is not None and not self.resp.staging_completion.done():
            t = time.perf_counter()
            self.resp.staging_completion.result()
            t1 = time.perf_counter()
            self.wait_s.append(t1 - t)
            self._blocked(t, t1, "wait")

    def drain(self) -> None:
        if self.resp is not None:
            t = time.perf_counter()
            self.resp.staging_completion.result()
            self.resp.upload_completion.result()
            self._blocked(t, time.perf_counter(), "drain")
            self.resp = None

    def close(self) -> None:
        self.drain()
        self.stager.close()


class OneThreadInBackground(Mode):
    """A floor measured in place: each save starts one daemon thread (after joining the previous
    one, counted as a wait); ``drain()`` joins it; an error on it is raised by the next join."""

    def __init__(self, out_dir: Path) -> None:
        super().__init__(out_dir)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _start(self, what: str, target: Any, args: tuple[Any, ...]) -> None:
        """Run ``target(*args)`` (it returns the bytes it wrote) on the thread; its span, as
        ``what``, its speed and its error are recorded by ``_run``."""
        self._join("wait")
        t = time.perf_counter()
        self.thread = threading.Thread(target=self._run, args=(what, target, args), name=self.name, daemon=True)
        self.thread.start()
        self.call_s.append(time.perf_counter() - t)

    def _run(self, what: str, target: Any, args: tuple[Any, ...]) -> None:
        t, nbytes = time.perf_counter(), 0
        try:
            nbytes = target(*args)
        except BaseException as exc:
            self.error = exc
        end = time.perf_counter()
        self.background.append((t, end, what))
        self.write_gbps.append(nbytes / max(end - t, 1e-9) / 1e9)

    def _join(self, what: str) -> None:
        if self.thread is not None:
            t = time.perf_counter()
            self.thread.join()
            t1 = time.perf_counter()
            self.thread = None
            if what == "wait":
                self.wait_s.append(t1 - t)
            self._blocked(t, t1, what)
        if self.error is not None:
            raise RuntimeError(f"{self.name}: the background work failed") from self.error

    def drain(self) -> None:
        self._join("drain")


class WriteOnly(OneThreadInBackground):
    """Not a checkpointer: the disk's part of any background checkpointer, measured in place.

    After each step, ``writers`` background threads (lazyckpt's writer count, so the disk sees the
    same queue depth) write as many bytes as one checkpoint from a buffer the training never
    touches, 64 MiB per call at their own offsets (O_DIRECT where the filesystem takes it, as
    lazyckpt does; otherwise buffered), then one fsync: no copy, no CRC, no pickling, no
    consistency. A save first waits for the previous write (one file at a time, as the storage
    floor assumes). Its stall is the floor *measured*: the final drain plus whatever the write
    itself takes from the training on this machine (kernel I/O work, interrupts, memory traffic),
    which the computed floor assumes is zero. lazyckpt's stall minus this one is the engine's own
    cost."""

    name = "write-only"
    CHUNK = 64 << 20

    def __init__(self, out_dir: Path, writers: int = 4) -> None:
        super().__init__(out_dir)
        self.path = out_dir / "write-only.bin"
        self.writers = max(1, writers)
        self.buf: mmap.mmap | None = None  # page-aligned, as O_DIRECT needs

    def _buffer(self, nbytes: int) -> mmap.mmap:
        size = -(-nbytes // self.CHUNK) * self.CHUNK
        if self.buf is None or len(self.buf) != size:
            self.buf = mmap.mmap(-1, size)
            block = os.urandom(1 << 20)
            for off in range(0, size, len(block)):
                self.buf[off : off + len(block)] = block
        return self.buf

    def _write(self, nbytes: int) -> int:
        buf = self._buffer(nbytes)
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_DIRECT", 0), 0o644)
        except OSError:  # tmpfs and others refuse O_DIRECT
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(buf)
            offsets = list(range(0, nbytes, self.CHUNK))

            def write_some(k: int) -> None:
                for off in offsets[k :: self.writers]:
                    # O_DIRECT wants lengths in whole pages: the last one is rounded up
                    n = -(-min(self.CHUNK, nbytes - off) // 4096) * 4096
                    pwrite_all(fd, view[off : off + n], off)

            threads = [threading.Thread(target=write_some, args=(k,)) for k in range(1, self.writers)]
            for th in threads:
                th.start()
            write_some(0)
            for th in threads:
                th.join()
            os.fsync(fd)
        finally:
            os.close(fd)
        return nbytes

    def save(self, state: dict[str, Any], nbytes: int) -> None:
        self._join("wait")  # before the buffer: the previous write reads it
        self._buffer(nbytes)
        self._start("write", self._write, (nbytes,))

    def close(self) -> None:
        self.drain()
        self.path.unlink(missing_ok=True)


class Lazy(Mode):
    """LazyCheckpointer(fsync=True, crc=True, on_backpressure="block") with the optimizer tracked."""

    name = "lazyckpt"

    def __init__(self, out_dir: Path, optimizer: torch.optim.Optimizer, writer_threads: int,
                 background_only: bool = False) -> None:  # fmt: skip
        super().__init__(out_dir)
        from lazyckpt import LazyCheckpointer

        self.ckpt = LazyCheckpointer(writer_threads=writer_threads, fsync=True, on_backpressure="block", crc=True)
        self.ckpt.track(optimizer)
        # background_only: never write inside save(), even on a memory filesystem with every core busy
        self.placement = False if background_only else None
        if background_only:
            self.name = "lazyckpt-bg"
        self.path = out_dir / ("lazy-bg.pt" if background_only else "lazy.pt")
        self.handles: list[tuple[float, Any]] = []
        self.stats: list[Any] = []

    def reset_metrics(self) -> None:
        super().reset_metrics()
        self.handles, self.stats = [], []

    def save(self, state: dict[str, Any], nbytes: int) -> None:
        t = time.perf_counter()
        with write_in_save(self.placement):
            self.handles.append((t, self.ckpt.save(state, self.path)))
        t1 = time.perf_counter()
        self.call_s.append(t1 - t)
        self._blocked(t, t1, "save")

    def drain(self) -> None:
        t = time.perf_counter()
        self.ckpt.wait()
        if self.handles:
            self._blocked(t, time.perf_counter(), "drain")
        for t_save, handle in self.handles:
            stats = handle.wait()
            self.stats.append(stats)
            self.background.append((t_save, t_save + stats.staged_s, "stage"))
            self.background.append((t_save + stats.durable_s - stats.write_s, t_save + stats.durable_s, "write"))
            if stats.write_gbps:
                self.write_gbps.append(stats.write_gbps)
        self.handles = []

    def close(self) -> None:
        self.drain()
        self.ckpt.close()

    def metrics(self) -> dict[str, Any]:
        m = super().metrics()
        for f in ("bytes", "blocked_s", "staged_s", "durable_s", "write_s", "guard_wait_s"):
            m[f] = _median([getattr(s, f) for s in self.stats])
        m["guard_wait_s_total"] = sum(s.guard_wait_s for s in self.stats)
        m["skipped"] = sum(bool(s.skipped) for s in self.stats)
        return m


def make_modes(names: list[str], out_dir: Path, device: torch.device, optimizer: torch.optim.Optimizer,
               writer_threads: int) -> dict[str, Mode]:  # fmt: skip
    factories = {
        "none": lambda: Mode(out_dir),
        "torch.save": lambda: TorchSave(out_dir),
        "dcp": lambda: DCPAsync(out_dir, device),
        "write-only": lambda: WriteOnly(out_dir, writer_threads),
        "lazyckpt": lambda: Lazy(out_dir, optimizer, writer_threads),
        "lazyckpt-bg": lambda: Lazy(out_dir, optimizer, writer_threads, background_only=True),
    }
    return {name: factories[name]() for name in names}


def unavailable_peers(names: list[str]) -> dict[str, str]:
    """Modes that cannot run here, with the reason (they are skipped with a note)."""
    out = {}
    if "dcp" in names:
        try:
            from torch.distributed.checkpoint import async_save  # noqa: F401
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions  # noqa: F401
        except ImportError as exc:
            out["dcp"] = f"torch {torch.__version__} has no DCP async_save with DefaultStager ({exc}); needs torch>=2.9"
    return out


def _median(xs: list[Any]) -> float | None:
    import statistics

    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None
