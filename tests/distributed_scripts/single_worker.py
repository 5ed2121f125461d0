"""One rank of a single-writer replication test (CPU, gloo): DDP-style, every rank holds the same
state; ``LazyCheckpointer(levels=[Level(mem/node<n>, every=1, keep=2, replicas=1), Level(disk,
every=3, keep=2)])`` built on every rank, global rank 0 alone saves. ``per_node`` ranks share one
memory folder (standing for a node).

Usage: single_worker.py SCENARIO RANK WORLD PORT WORKDIR (``tests/_worker.py``); the run comes from
the env var LAZYCKPT_TEST_SINGLE (JSON: ``mem``, ``disk``, ``per_node``, ``steps``, ``corrupt_step``,
``replicas`` (default 1)).
Rank 0 writes WORKDIR/state-<step>.pt (torch.save, the state each save was given) as the reference.
"""

from __future__ import annotations

import json
import os
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist

import _worker
import lazyckpt
from _util import DiesOnRead, assert_same
from lazyckpt import LazyCheckpointer, Level

ARGS = _worker.parse_argv()
SCENARIO, RANK, WORLD, PORT, WORKDIR = ARGS
RESULT: dict = {"ok": True}
CONFIG = json.loads(os.environ.get("LAZYCKPT_TEST_SINGLE", "{}"))


def node() -> int:
    return RANK // CONFIG.get("per_node", 1)


def levels() -> list[Level]:
    return [
        Level(os.path.join(CONFIG["mem"], f"node{node()}"), every=1, keep=2, replicas=CONFIG.get("replicas", 1)),
        Level(CONFIG["disk"], every=3, keep=2),
    ]


def state_at(step: int) -> dict:
    """What every rank holds after ``step`` steps (DDP: the same everywhere)."""
    g = torch.Generator().manual_seed(step)
    return {"w": torch.randn(256, 256, generator=g), "m": torch.randn(4096, generator=g), "step": step}


def scenario_train() -> None:
    """Every rank builds the checkpointer; rank 0 saves steps 1..steps; a corrupt_step's file is
    damaged on rank 0 right after its commit, before its copy is sent (the window forced)."""
    from lazyckpt.cluster import _single

    if RANK == 0 and CONFIG.get("corrupt_step"):
        real = _single.SingleWriter.submit

        def submit(self, step, path):
            if step == CONFIG["corrupt_step"]:
                with open(path, "r+b") as f:  # a byte of the first tensor's data (well inside the file)
                    f.seek(os.path.getsize(path) // 3)
                    byte = f.read(1)
                    f.seek(-1, 1)
                    f.write(bytes([byte[0] ^ 0xFF]))
            return real(self, step, path)

        _single.SingleWriter.submit = submit
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with LazyCheckpointer(levels=levels(), writer_threads=2) as ckpt:
            if RANK == 0:
                for step in range(1, CONFIG["steps"] + 1):
                    state = state_at(step)
                    torch.save(state, os.path.join(WORKDIR, f"state-{step}.pt"))
                    ckpt.save(state, step=step).wait()
                    if not RELEASE:  # each step's copy made before the next save: none is behind the backlog
                        ckpt.wait()
                for release in RELEASE:
                    release()
                ckpt.wait()
            else:
                try:
                    ckpt.save(state_at(1), step=1)
                except lazyckpt.SaveRefusedError as exc:
                    RESULT["refused"] = str(exc)
            dist.barrier()
        single = ckpt._levels._single  # noqa: SLF001 - the test reads the replication stats
        RESULT["stats"] = {  # after close(): a holder's ends with the writer's bye
            "steps": single.stats.steps_replicated,
            "sent": single.stats.bytes_sent,
            "received": single.stats.bytes_received,
            "not_replicated": sorted(single.stats.not_replicated),
            "errors": {s: [e.errno, e.partner] for s, e in single.stats.not_replicated.items()},
        }
    RESULT["warnings"] = [f"{w.category.__name__}: {w.message}" for w in seen if "lazyckpt" in str(w.message)]


def scenario_train_kill() -> None:
    """Rank 0 SIGKILLs itself as it reads its file of step kill_step to send it (the holder has
    announced the round and made its temporary file); the others stop with a typed error."""
    from lazyckpt.cluster import _wire

    if RANK == 0:
        real_run = _wire.Link.run

        def run(self, dst, header, files, src, sink_for):
            if header and header.get("step") == CONFIG["kill_step"]:
                files = [DiesOnRead(f) for f in files]
            return real_run(self, dst, header, files, src, sink_for)

        _wire.Link.run = run
    try:
        scenario_train()
    except RuntimeError as exc:  # gloo: the writer is gone
        RESULT["stopped_by"] = f"{type(exc).__name__}: {exc}"[:500]


def scenario_train_slow() -> None:
    """Rank 0's sending is held until every save is made (forced): with backlog=2, steps 1 and 2
    wait (one in flight, one queued), steps 3..5 go without copies; then it is released."""
    import threading

    from lazyckpt.cluster import _wire

    gate = threading.Event()
    if RANK == 0:
        real_run = _wire.Link.run

        def run(self, dst, header, files, src, sink_for):
            gate.wait(120)
            return real_run(self, dst, header, files, src, sink_for)

        _wire.Link.run = run
    RELEASE.append(gate.set)
    scenario_train()


RELEASE: list = []  # called by scenario_train once its saves are made


def scenario_train_holder_full() -> None:
    """The holder's memory is full when step CONFIG["full_step"]'s copy arrives (ENOSPC injected
    on its temporary file); the other steps are copied as usual."""
    import errno

    import lazyckpt.storage.fs as _fs

    if CONFIG.get("per_node", 1) == RANK:
        real = _fs.open_temporary
        name = f"step-{CONFIG['full_step']:08d}"

        def full(path, size):
            if name in os.path.basename(path):
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
            return real(path, size)

        _fs.open_temporary = full
    scenario_train()


def _alive(rank: int) -> bool:
    """Whether ``rank`` (which wrote WORKDIR/holder.pid before it killed itself) still runs."""
    try:
        with open(os.path.join(WORKDIR, "holder.pid")) as fh:
            pid = int(fh.read() or 0)
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, ValueError):
        return not os.path.exists(os.path.join(WORKDIR, "holder.pid"))


def scenario_train_holder_dead() -> None:
    """Node 1's first rank (the holder) is SIGKILLed once every rank has built the checkpointer;
    rank 0 then saves 5 steps as usual. RESULT["seconds"]: each save's wall time to durable."""
    import signal
    import time

    holder = CONFIG.get("per_node", 1)  # node 1's first rank
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ckpt = LazyCheckpointer(levels=levels(), writer_threads=2)  # collective
        if holder == RANK:
            with open(os.path.join(WORKDIR, "holder.pid"), "w") as fh:
                fh.write(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        if RANK != 0:
            ckpt.close()
            open(os.path.join(WORKDIR, f"closed-{RANK}"), "w").close()
            return
        deadline = time.monotonic() + 60
        others = [r for r in range(1, WORLD) if r != holder]
        while not all(os.path.exists(os.path.join(WORKDIR, f"closed-{r}")) for r in others) or _alive(holder):
            assert time.monotonic() < deadline, "the other ranks did not close, or the holder is alive"
            time.sleep(0.05)
        RESULT["seconds"] = []
        with ckpt:
            for step in range(1, CONFIG["steps"] + 1):
                t0 = time.monotonic()
                state = state_at(step)
                torch.save(state, os.path.join(WORKDIR, f"state-{step}.pt"))
                ckpt.save(state, step=step).wait()
                ckpt.wait()
                RESULT["seconds"].append(time.monotonic() - t0)
        single = ckpt._levels._single  # noqa: SLF001 - the test reads the replication stats
        stats = single.stats
        RESULT["stats"] = {"steps": stats.steps_replicated, "not_replicated": sorted(stats.not_replicated)}
        RESULT["errors"] = {s: (e.errno, e.partner) for s, e in stats.not_replicated.items()}
    RESULT["warnings"] = [f"{w.category.__name__}: {w.message}" for w in seen if "lazyckpt" in str(w.message)]


def scenario_restart() -> None:
    """A fresh job: ``latest(levels)`` on every rank (collective), then the state loaded exactly.
    RESULT["storage_reads"]: how many times this rank read a checkpoint's data, reading its storages
    or checking it (the restore's check of a node's newest file or of the copy it received, and
    ``latest()``'s own read, are one read)."""
    from lazyckpt.recovery import _preread
    from lazyckpt.recovery import verify as _verify

    RESULT["storage_reads"] = 0

    def counted(real):
        def read(*args, **kwargs):
            RESULT["storage_reads"] += 1
            return real(*args, **kwargs)

        return read

    _preread.read_storages = counted(_preread.read_storages)
    _verify.verify = counted(_verify.verify)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = lazyckpt.latest(levels())
    RESULT["warnings"] = [str(w.message) for w in seen]
    assert found is not None, "nothing found"
    RESULT["found"] = {"step": found.step, "level": found.level, "path": found.path}
    assert_same(lazyckpt.load(found), torch.load(os.path.join(WORKDIR, f"state-{found.step}.pt")))
    RESULT["restored"] = True
    dist.barrier()  # rank 0 hosts the store: it must not exit while the others still read it


def init() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    dist.init_process_group("gloo", rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60))


if __name__ == "__main__":
    _worker.run(ARGS, globals(), RESULT, init)
