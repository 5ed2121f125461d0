"""Where one checkpoint's time goes: per-phase times on the training thread, CPU per lazyckpt thread.

    python -m benchmarks.profile_stall --loop core --threads 1          # plain loop + LazyCheckpointer
    python -m benchmarks.profile_stall --loop levels --threads 1 --dir /dev/shm   # + one memory level (keep 2)
    python -m benchmarks.profile_stall --loop lightning --threads 1     # Trainer.fit + LazyCheckpointIO
    python -m benchmarks.profile_stall --loop accelerate --threads 1    # save_state + lazyckpt.accelerate
    python -m benchmarks.profile_stall --loop accelerate-levels --threads 1 --dir /dev/shm   # by level, keep 2

Trains the ~98M GPT with a checkpoint after every one of ``--steps`` steps (lazyckpt, fsync, CRC32, as
in the benchmarks) once per loop and prints, for the checkpoints of that run:

* training thread: time per phase (forward+backward, optimizer step including the guard's wait, the
  save call: ``save()``, ``save_checkpoint`` or ``save_state``, and the final drain), per checkpoint;
* every thread's CPU seconds (user/system) from ``/proc/self/task/<tid>/stat``, named by their Python
  thread name (lazyckpt's threads are ``lazyckpt-*``), per checkpoint;
* the host-buffer chunks the pool allocated (and faulted in) during the run, on which thread.

Per-thread CPU time is far less sensitive to other load on the machine than wall-clock stalls, which
is why this complements the benchmarks' end-to-end figures. No stock peer runs here.
"""

from __future__ import annotations

import argparse
import functools
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from . import gpt as _gpt

_TICK = os.sysconf("SC_CLK_TCK")


class ThreadCPU:
    """CPU seconds per thread name, accumulated across snapshots (threads that end keep their last figure)."""

    def __init__(self) -> None:
        self.names: dict[int, str] = {}
        self.start: dict[int, tuple[float, float]] = {}
        self.last: dict[int, tuple[float, float]] = {}

    def _read(self) -> dict[int, tuple[float, float]]:
        for t in threading.enumerate():
            if t.native_id is not None:
                self.names[t.native_id] = t.name
        out = {}
        for tid in os.listdir("/proc/self/task"):
            try:
                with open(f"/proc/self/task/{tid}/stat") as fh:
                    stat = fh.read()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            out[int(tid)] = (int(fields[11]) / _TICK, int(fields[12]) / _TICK)
            if int(tid) not in self.names:
                self.names[int(tid)] = stat[stat.index("(") + 1 : stat.rindex(")")]
        return out

    def begin(self) -> None:
        self.start = self._read()
        self.last = dict(self.start)

    def snapshot(self) -> None:
        self.last.update(self._read())

    def per_name(self) -> dict[str, tuple[float, float]]:
        out: dict[str, list[float]] = {}
        for tid, (u, s) in self.last.items():
            u0, s0 = self.start.get(tid, (0.0, 0.0))
            name = self.names.get(tid, str(tid))
            if name.startswith("lazyckpt-writer-"):
                name = "lazyckpt-writer-*"
            acc = out.setdefault(name, [0.0, 0.0])
            acc[0] += u - u0
            acc[1] += s - s0
        return {k: (v[0], v[1]) for k, v in out.items()}


class Phases:
    """Wall time per named phase on the training thread."""

    def __init__(self) -> None:
        self.s: dict[str, float] = {}
        self.n: dict[str, int] = {}
        self.each: dict[str, list[float]] = {}

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        t = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t
            self.s[name] = self.s.get(name, 0.0) + dt
            self.n[name] = self.n.get(name, 0) + 1
            self.each.setdefault(name, []).append(dt)


def _watch_pool(chunks: list[tuple[str, float, int]]) -> Callable[[], None]:
    """Record every host-buffer chunk the pool creates (thread, seconds, bytes); returns the undo."""
    from lazyckpt.core import pool as _pool

    orig = _pool.HostBufferPool._new_chunk

    def new_chunk(self: Any) -> Any:
        t = time.perf_counter()
        try:
            return orig(self)
        finally:
            chunks.append((threading.current_thread().name, time.perf_counter() - t, self.chunk_bytes))

    _pool.HostBufferPool._new_chunk = new_chunk  # type: ignore[method-assign]
    return lambda: setattr(_pool.HostBufferPool, "_new_chunk", orig)


def _snapshot_before_close(cpu: ThreadCPU) -> Callable[[], None]:
    """lazyckpt's threads end in ``close()``: read their CPU time just before."""
    from lazyckpt import checkpointer as _ck

    orig = _ck.LazyCheckpointer.close

    def close(self: Any, *a: Any, **k: Any) -> Any:
        cpu.snapshot()
        return orig(self, *a, **k)

    _ck.LazyCheckpointer.close = close  # type: ignore[method-assign]
    return lambda: setattr(_ck.LazyCheckpointer, "close", orig)


def _step_timer(phases: Phases, opt_cls: type) -> Callable[[], None]:
    """Time ``optimizer.step`` (the guard's wait included: it is a step pre-hook)."""
    orig = opt_cls.step

    def step(self: Any, *a: Any, **k: Any) -> Any:
        with phases("optimizer.step (guard wait included)"):
            return orig(self, *a, **k)

    opt_cls.step = step
    return lambda: setattr(opt_cls, "step", orig)


def _guard_timer(phases: Phases) -> Callable[[], None]:
    """Time the guard's wait (``Job.release_guard``: copies of live pieces and the wait for pieces in flight)."""
    from lazyckpt.core import job as _job

    orig = _job.Job.release_guard

    def release_guard(self: Any) -> None:
        with phases("guard wait (part of optimizer.step)"):
            orig(self)

    _job.Job.release_guard = release_guard  # type: ignore[method-assign]
    return lambda: setattr(_job.Job, "release_guard", orig)


def run_core(args: argparse.Namespace, out: Path, ph: Phases) -> None:
    from lazyckpt import LazyCheckpointer

    cfg = _gpt.config_for(args.size)
    model, batches = _gpt.build(cfg, seed=0), _gpt.BatchStream(cfg, seed=0)
    opt = _gpt.make_optimizer(model)
    _gpt.train_step(model, opt, batches.next())
    with ph("create checkpointer"):
        ckpt = LazyCheckpointer(fsync=True, crc=True)
        ckpt.track(opt)
    for i in range(args.steps):
        with ph("train step (forward, backward, step)"):
            _gpt.train_step(model, opt, batches.next())
        with ph("save()"):
            ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": i}, out / "core.pt")
    with ph("final drain (wait)"):
        ckpt.wait()
    ckpt.close()


def run_levels(args: argparse.Namespace, out: Path, ph: Phases) -> None:
    """The plain loop with one memory-like level (``--dir``): ``save(state, step=i)``, keep 2, so
    from the third save on retention hands the dropped file's pages to the next save."""
    from lazyckpt import LazyCheckpointer, Level

    cfg = _gpt.config_for(args.size)
    model, batches = _gpt.build(cfg, seed=0), _gpt.BatchStream(cfg, seed=0)
    opt = _gpt.make_optimizer(model)
    _gpt.train_step(model, opt, batches.next())
    with ph("create checkpointer"):
        ckpt = LazyCheckpointer(levels=[Level(str(out), every=1, keep=2)], fsync=True, crc=True)
        ckpt.track(opt)
    for i in range(args.steps):
        with ph("train step (forward, backward, step)"):
            _gpt.train_step(model, opt, batches.next())
        with ph("save()"):
            ckpt.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": i}, step=i + 1)
    with ph("final drain (wait)"):
        ckpt.wait()
    ckpt.close()


def run_lightning(args: argparse.Namespace, out: Path, ph: Phases) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from examples.lightning_gpt import GPT
    from lazyckpt.lightning import LazyCheckpointIO

    class Timed(LazyCheckpointIO):
        def save_checkpoint(self, *a: Any, **k: Any) -> None:
            with ph("save_checkpoint"):
                super().save_checkpoint(*a, **k)

        def remove_checkpoint(self, *a: Any, **k: Any) -> None:
            with ph("remove_checkpoint"):
                super().remove_checkpoint(*a, **k)

        def teardown(self) -> None:
            with ph("teardown (final drain)"):
                super().teardown()

    class Model(GPT):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            with ph("training_step (forward)"):
                return super().training_step(batch, batch_idx)

    cfg = _gpt.config_for(args.size)
    L.seed_everything(0, verbose=False)
    model = Model(vocab=cfg.vocab_size, dim=cfg.n_embd, layers=cfg.n_layer, heads=cfg.n_head, seq=cfg.block_size,
                  batch_size=cfg.batch_size, steps=args.steps)  # fmt: skip
    ckpt_cb = ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_top_k=1)
    orig_save = ckpt_cb._save_checkpoint

    def save(trainer: Any, filepath: str) -> None:
        with ph("ModelCheckpoint save (state dict + plugin)"):
            orig_save(trainer, filepath)

    ckpt_cb._save_checkpoint = save  # type: ignore[method-assign]
    trainer = L.Trainer(accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[ckpt_cb], plugins=[Timed()])  # fmt: skip
    with ph("Trainer.fit (total)"):
        trainer.fit(model)


def run_accelerate(args: argparse.Namespace, out: Path, ph: Phases, *, levels: bool = False) -> None:
    """``save_state()`` after every step into automatic folders; ``levels``: by level instead, one
    memory-like level (``--dir``) every step, keep 2 (from the third save on, each step folder's
    files are written over the pages of the one retention dropped)."""
    import lazyckpt.accelerate
    from lazyckpt import Level

    from ._accelerate_loop import prepared_gpt

    loop = prepared_gpt(args.size, str(out / "project") if levels else str(out))
    acc, train_step = loop.acc, loop.step
    if levels:
        acc.project_configuration.automatic_checkpoint_naming = False  # the level names its folders
    train_step()
    with ph("install (creates the checkpointer)"):
        given = [Level(str(out / "level"), every=1, keep=2)] if levels else None
        handle = lazyckpt.accelerate.install(acc, levels=given)
    for _ in range(args.steps):
        with ph("train step (forward, backward, step)"):
            train_step()
        with ph("save_state"):
            acc.save_state()
    with ph("final drain (handle.wait)"):
        handle.wait()
    handle.uninstall()


LOOPS = {
    "core": run_core,
    "levels": run_levels,
    "lightning": run_lightning,
    "accelerate": run_accelerate,
    "accelerate-levels": functools.partial(run_accelerate, levels=True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loop", choices=sorted(LOOPS), default="core")
    p.add_argument("--size", default="100m", help="tiny | small | 100m (benchmarks/gpt.py)")
    p.add_argument("--steps", type=int, default=5, help="steps, each followed by a checkpoint")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (1: the spare-core regime)")
    p.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    ph, cpu, chunks = Phases(), ThreadCPU(), []
    undo = [_watch_pool(chunks), _snapshot_before_close(cpu), _step_timer(ph, torch.optim.AdamW), _guard_timer(ph)]
    try:
        with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
            cpu.begin()
            t = time.perf_counter()
            LOOPS[args.loop](args, Path(tmp), ph)
            wall = time.perf_counter() - t
            cpu.snapshot()
    finally:
        for u in undo:
            u()
    n = args.steps
    print(f"{args.loop}: {args.size} GPT, {n} checkpoints, {torch.get_num_threads()} torch thread(s) on "
          f"{os.cpu_count()} CPUs, {wall:.1f} s in all")  # fmt: skip
    print("training thread, per checkpoint (s):")
    for name, s in ph.s.items():
        print(f"  {name:<45} {s / n:8.3f}   (total {s:.3f} s over {ph.n[name]} call(s))")
        if 1 < ph.n[name] <= 64:
            print(f"  {'':<45} each: {' '.join(f'{x:.3f}' for x in ph.each[name])}")
    print("CPU per thread, per checkpoint (s, user + system):")
    rows = sorted(cpu.per_name().items(), key=lambda kv: -(kv[1][0] + kv[1][1]))
    for name, (u, s) in rows:
        if u + s >= 0.005:
            print(f"  {name:<45} {(u + s) / n:8.3f}   (user {u / n:.3f}, system {s / n:.3f})")
    lazy = sum(u + s for name, (u, s) in rows if name.startswith("lazyckpt"))
    print(f"  {'all lazyckpt-* threads':<45} {lazy / n:8.3f}")
    if chunks:
        by: dict[str, list[float]] = {}
        for name, dt, nbytes in chunks:
            acc = by.setdefault(name, [0, 0.0, 0])
            acc[0] += 1
            acc[1] += dt
            acc[2] += nbytes
        print("host-buffer chunks allocated and faulted in: " + "; ".join(
            f"{k}: {int(v[0])} x {int(v[2] / v[0]) >> 20} MiB in {v[1]:.3f} s" for k, v in by.items()))  # fmt: skip


if __name__ == "__main__":
    main()
