"""One rank of a multi-level DistributedCheckpointer test (CPU, gloo): FSDP2 + AdamW plus replicated
state, a node-local memory level (each rank its own /dev/shm folder, standing for its node), a
shared disk level, optionally an S3 level.

Usage: levels_worker.py SCENARIO RANK WORLD PORT WORKDIR (``tests/_worker.py``); the levels and
the run come from the env var LAZYCKPT_TEST_LEVELS (JSON: ``mem`` base folder, ``disk``, ``s3`` URL
or null, ``every`` per level, ``keep``, ``steps``, ``kill_step``). Writes WORKDIR/result-<rank>.json.

The state at every save is dumped whole (gathered, rank 0 writes ``dump-<step>.pt``) BEFORE the
save, so every checkpoint that can exist has its expected state.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import warnings
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import _worker
import lazyckpt
from _util import DiesOnRead, assert_same, fsdp_model, full_dump, kill_node, rank_step, register_node_pid
from lazyckpt import Level
from lazyckpt.distributed import DistributedCheckpointer, DistributedLevelError

ARGS = _worker.parse_argv()
SCENARIO, RANK, WORLD, PORT, WORKDIR = ARGS
RESULT: dict = {"ok": True}
CONFIG = json.loads(os.environ.get("LAZYCKPT_TEST_LEVELS", "{}"))
OPTS = dict(host_memory_budget=8 << 20, chunk_bytes=1 << 20, writer_threads=2, commit_timeout=60)
WIDTH = 64  # 16 KiB per weight: rank files of a few hundred KiB


def levels() -> list[Level]:
    """This rank's view of the levels: its node's memory folder, the shared disk, S3."""
    every, keep = CONFIG.get("every", [1, 3, 6]), CONFIG.get("keep", [2, 2, 2])
    out = [
        Level(mem_folder(), every=every[0], keep=keep[0], replicas=CONFIG.get("replicas", 0)),
        Level(CONFIG["disk"], every=every[1], keep=keep[1]),
    ]
    if CONFIG.get("s3"):
        out.append(Level(CONFIG["s3"], every=every[2], keep=keep[2]))
    return out


def node() -> int:
    """This rank's node: ``per_node`` ranks each (CONFIG; default 1, each rank a node)."""
    return RANK // CONFIG.get("per_node", 1)


def mem_folder() -> str:
    return os.path.join(CONFIG["mem"], f"node{node()}")


def options() -> dict:
    opts = dict(OPTS)
    if CONFIG.get("s3"):
        opts.update(storage_options=CONFIG["storage_options"], local_dir=os.path.join(WORKDIR, f"tier-{RANK}"))
    if CONFIG.get("commit_timeout"):
        opts.update(commit_timeout=CONFIG["commit_timeout"])
    return opts


def replicated(step: int) -> dict:
    """DDP-style replicated state: the same values on every rank (DCP writes each item once,
    unless lazyckpt keeps a copy per node for the node-local level)."""
    return {"ema": torch.arange(512.0) * step, "counter": torch.tensor(step), "note": f"step {step}"}


def state_of(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd, "extra": replicated(step), "step": step}


def full(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> dict:
    """The whole state (gathered: collective), cloned."""
    return {**full_dump(model, opt), "extra": replicated(step), "step": step}


def dump_path(step: int) -> str:
    return os.path.join(WORKDIR, f"dump-{step}.pt")


def train(ckpt: DistributedCheckpointer, first: int, steps: int, on_step=None) -> dict:
    """Train ``steps`` steps from ``first``, saving every step (the levels decide where); the
    handles by step."""
    model, opt = fsdp_model(WIDTH)
    handles = {}
    for step in range(first, first + steps):
        rank_step(model, opt, step, width=WIDTH)
        whole = full(model, opt, step)
        if RANK == 0:
            torch.save(whole, dump_path(step))
        dist.barrier()  # the dump is on disk before any rank saves
        if on_step is not None:
            on_step(step)
        handles[step] = ckpt.save(state_of(model, opt, step), step=step)
    return handles


def restore(found, storage_options: dict | None = None) -> dict:
    """Load ``found`` (this rank's path) with stock DCP into a fresh FSDP2 model and optimizer
    whose optimizer state holds other values; return the whole state, gathered."""
    model, opt = fsdp_model(WIDTH)
    rank_step(model, opt, 999, width=WIDTH)
    state = state_of(model, opt, -1)
    if found.path.startswith("s3://"):
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(state, storage_reader=FsspecReader(found.path, **storage_options))
    else:
        dcp.load(state, checkpoint_id=found.path)
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return {"model_optim": full(model, opt, -1), "extra": state["extra"], "step": state["step"]}


def check_restored(found, storage_options: dict | None = None) -> None:
    got = restore(found, storage_options)
    want = torch.load(dump_path(found.step), weights_only=False)
    assert got["step"] == found.step, (got["step"], found.step)
    assert_same(got["model_optim"]["model"], want["model"], "model", loose=True)
    assert_same(got["model_optim"]["optim"], want["optim"], "optim", loose=True)
    assert_same(got["extra"], want["extra"], "extra", loose=True)


# -- scenarios ---------------------------------------------------------------------------------------


def scenario_train() -> None:
    """Save every step for CONFIG["steps"] steps; wait; report what each step reached. ``fail_remove``: rank 0's
    deletions (retention: it owns the shared level and its node's) fail with EBUSY (RESULT["close_raised"]: the
    errno close() raised)."""
    if CONFIG.get("fail_remove") and RANK == 0:
        import errno

        from lazyckpt.core import removal

        def busy(path, keep=()):
            raise OSError(errno.EBUSY, "Device or resource busy (injected)", path)

        removal._delete = busy
    ckpt = DistributedCheckpointer(levels=levels(), **options())
    handles = train(ckpt, 1, CONFIG.get("steps", 7))
    done = {step: h.wait() and h.levels_done for step, h in handles.items()}
    RESULT["levels_done"] = done
    RESULT["scopes"] = [s.node_local for s in ckpt_scopes(ckpt)]
    try:
        ckpt.close()
        RESULT["close_raised"] = None
    except OSError as exc:
        if not CONFIG.get("fail_remove"):
            raise
        RESULT["close_raised"] = exc.errno
    RESULT["listing"] = {lv.path: sorted(os.listdir(lv.path)) for lv in levels() if not lv.is_url}


def ckpt_scopes(ckpt):
    """Which levels the checkpointer found node-local (the test looks inside)."""
    return ckpt._levels.scopes


def scenario_restart() -> None:
    """Both ways to ask, on every rank: ``lazyckpt.latest(levels)`` (collective by itself) and
    ``DistributedCheckpointer.latest()``; then the state loaded with stock DCP equals the dump."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = lazyckpt.latest(levels(), CONFIG.get("storage_options"))
    RESULT["warnings"] = [str(w.message) for w in seen]
    assert found is not None, "nothing found"
    RESULT["found"] = {"step": found.step, "level": found.level, "path": found.path}
    with DistributedCheckpointer(levels=levels(), **options()) as ckpt, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the same skipped copies, said above
        again = ckpt.latest()
        assert again == found, (again, found)
    check_restored(found, CONFIG.get("storage_options"))
    RESULT["restored"] = True


def scenario_kill() -> None:
    """Rank 1 SIGKILLs itself at the first write of step CONFIG["kill_step"]'s save (its memory
    file, or a copy still running); rank 0 fails (its next collective, or the save) and stops."""
    import lazyckpt.storage.fs as _fs

    armed = []
    if RANK == 1:
        real = _fs.pwrite_all

        def pwrite_all(fd, data, offset):
            if armed:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(fd, data, offset)

        _fs.pwrite_all = pwrite_all

    def arm(step: int) -> None:
        if step == CONFIG["kill_step"]:
            armed.append(True)

    ckpt = DistributedCheckpointer(levels=levels(), **options())
    try:
        train(ckpt, 1, CONFIG["kill_step"] + 3, on_step=arm)
        ckpt.wait()
        raise AssertionError("training went on although rank 1 died")
    except (RuntimeError, DistributedLevelError, TimeoutError) as exc:  # gloo: the peer is gone
        RESULT["stopped_by"] = f"{type(exc).__name__}: {exc}"[:500]


def scenario_enospc() -> None:
    """The disk level is full on rank 1 only: every disk-due step fails on both ranks with one
    DistributedLevelError naming level 1 and rank 1 (once: not again from wait()); the memory
    level keeps every step."""
    import lazyckpt.storage.fs as _fs

    disk = levels()[1].path
    if RANK == 1:
        real = _fs.open_temporary

        def full(path, size):
            if os.path.dirname(os.path.dirname(path)) == disk:  # a file in a staging folder of the disk level
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
            return real(path, size)

        _fs.open_temporary = full
    with DistributedCheckpointer(levels=levels(), **options()) as ckpt:
        handles = train(ckpt, 1, CONFIG.get("steps", 7))
        errors = {}
        for step, h in handles.items():
            try:
                RESULT.setdefault("ok_steps", []).append([step, h.wait() and h.levels_done])
            except DistributedLevelError as exc:
                errors[step] = {
                    "level": exc.level, "level_path": exc.level_path, "step": exc.step, "ranks": list(exc.ranks),
                    "errno": exc.errno, "cause": type(exc.__cause__).__name__, "message": str(exc),
                    "levels_done": h.levels_done,
                }  # fmt: skip
        RESULT["errors"] = errors
        ckpt.wait()  # every error was raised by its handle: nothing again here
    RESULT["mem"] = sorted(os.listdir(levels()[0].path))
    RESULT["disk"] = sorted(os.listdir(disk))


def scenario_extra() -> None:
    """Steps 1-4, each with extra files that differ per rank (rank 0's must land in every level
    folder, each node's memory folder included); step 2 with ``due=[1]`` (the disk level only,
    although memory is due at every step); then ``due=`` with an index out of range, refused alike."""
    from lazyckpt import SaveRefusedError

    with DistributedCheckpointer(levels=levels(), **options()) as ckpt:
        model, opt = fsdp_model(WIDTH)
        for step in (1, 2, 3, 4):
            rank_step(model, opt, step, width=WIDTH)
            extra = {"meta.pt": f"step {step} from rank {RANK}".encode(), "note.txt": b"n" * (RANK + 1)}
            due = [1] if step == 2 else None
            h = ckpt.save(state_of(model, opt, step), step=step, due=due, extra_files=extra)
            RESULT.setdefault("levels_done", {})[step] = h.wait() and h.levels_done
        try:
            ckpt.save(state_of(model, opt, 5), step=5, due=[len(levels())])
        except SaveRefusedError as exc:
            RESULT["refused"] = str(exc)


def scenario_rollback() -> None:
    """Rolled back to the disk level's step 3 (the later steps learned badly): the first save, at
    step 4, removes the abandoned step 6 from the shared disk level before it returns (rank 0, the
    folder's owner, lists it right then), though the disk level is not due until step 6."""
    with DistributedCheckpointer(levels=levels(), **options()) as ckpt:
        assert ckpt.latest().step == 7
        model, opt = fsdp_model(WIDTH)
        rank_step(model, opt, 4, width=WIDTH)
        whole = full(model, opt, 4)
        if RANK == 0:
            torch.save(whole, dump_path(4))
        dist.barrier()
        h = ckpt.save(state_of(model, opt, 4), step=4)
        RESULT["disk_at_return"] = sorted(n for n in os.listdir(CONFIG["disk"]) if not n.startswith("."))
        RESULT["levels_done"] = h.wait() and h.levels_done
    RESULT["mem"] = sorted(os.listdir(levels()[0].path))


def tree(root: str) -> list[str]:
    """Every file under ``root`` (relative paths), temporaries included."""
    return sorted(os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names)


def scenario_replicate() -> None:
    """Train CONFIG["steps"] steps with a replicated memory level; wait; this rank's replication
    stats and its node's memory folder (replicas included)."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with DistributedCheckpointer(levels=levels(), **options()) as ckpt:
            handles = train(ckpt, 1, CONFIG.get("steps", 5))
            RESULT["levels_done"] = {step: h.wait() and h.levels_done for step, h in handles.items()}
            ckpt.wait()
            stats = ckpt.replication
            assert stats is not None
            RESULT["stats"] = {
                "steps": stats.steps_replicated, "sent": stats.bytes_sent, "received": stats.bytes_received,
                "not_replicated": {s: [e.errno, e.partner, str(e)] for s, e in stats.not_replicated.items()},
            }  # fmt: skip
    RESULT["warnings"] = [f"{w.category.__name__}: {w.message}" for w in seen]
    if RANK % CONFIG.get("per_node", 1) == 0:
        RESULT["tree"] = tree(mem_folder())


def scenario_replicate_enospc() -> None:
    """The replicas' memory of rank CONFIG["full_rank"] is full (ENOSPC on every replica file it
    receives): its sender's steps are not replicated (one ReplicationWarning), the local copies
    stand, training goes on."""
    import lazyckpt.storage.fs as _fs

    if CONFIG["full_rank"] == RANK:
        real = _fs.open_temporary

        def full(path, size):
            if "/replicas/" in path:
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
            return real(path, size)

        _fs.open_temporary = full
    scenario_replicate()


def scenario_restart_checkpointer_first() -> None:
    """A fresh job asks its DistributedCheckpointer first (``ckpt.latest()``: the restore runs on the
    checkpointer's replication group), then loads with stock DCP."""
    with DistributedCheckpointer(levels=levels(), **options()) as ckpt:
        found = ckpt.latest()
        assert found is not None, "nothing found"
        RESULT["found"] = {"step": found.step, "level": found.level, "path": found.path}
        check_restored(found)
        RESULT["restored"] = True


def scenario_replicate_corrupt_source() -> None:
    """Rank 0's committed memory file of step 2 gets a flipped byte before it is replicated (node
    memory corrupted after the commit): the partner refuses it (not the primary's CRC32), rank 0
    records step 2 as not replicated; the other steps replicate."""
    from lazyckpt.cluster import _replica

    if RANK == 0:
        real = _replica.Replicator.submit

        def submit(self, index, step, folder, files):
            if step == 2:
                path = os.path.join(folder, "__0_0.distcp")
                with open(path, "r+b") as fh:
                    fh.seek(os.path.getsize(path) // 2)
                    byte = fh.read(1)[0]
                    fh.seek(-1, os.SEEK_CUR)
                    fh.write(bytes([byte ^ 0xFF]))
            return real(self, index, step, folder, files)

        _replica.Replicator.submit = submit
    scenario_replicate()


def scenario_replicate_partner_silent() -> None:
    """Rank CONFIG["silent_rank"]'s replicator never takes part (its thread runs nothing: a partner
    whose replication side is dead while its training goes on): its partner's first round fails at
    the replication group's timeout, that pair is not used again, every later step is recorded as
    not replicated with one warning; training and the other links go on. RESULT["rounds_with_silent"]:
    this rank's rounds that named the silent rank (its broken pair must not be used again)."""
    from lazyckpt.cluster import _replica, _wire

    silent = CONFIG["silent_rank"]
    if silent == RANK:
        _replica.Replicator._replicate = lambda self, item: None
    RESULT["rounds_with_silent"] = 0
    real_run = _wire.Link.run

    def run(self, dst, header, files, src, sink_for):
        if silent in (dst, src):
            RESULT["rounds_with_silent"] += 1
        return real_run(self, dst, header, files, src, sink_for)

    _wire.Link.run = run
    scenario_replicate()


def scenario_replicate_kill() -> None:
    """Node CONFIG["kill_node"] is lost while receiving the replica of step CONFIG["kill_step"]
    (mid-file): the first of its ranks to get there SIGKILLs all of them at once (the node's other
    ranks first, then itself), as a lost machine would; the survivors stop with a typed error in
    bounded time. (Each rank killing only itself left a race in the test: a rank whose partner died
    first could stop with a typed error, its training's collective failing, before its own kill.)"""
    from lazyckpt.cluster import _wire

    if node() == CONFIG["kill_node"]:
        pids = os.path.join(WORKDIR, f"pids-node-{node()}")
        register_node_pid(pids, RANK)  # before step 1's collectives: all there by step 3
        real = _wire.Sink.write

        def write(self, data, offset):
            if self.header.get("step") == CONFIG["kill_step"] and offset == 0:
                kill_node(pids)
            return real(self, data, offset)

        _wire.Sink.write = write
    train_until_a_peer_dies()


def scenario_replicate_kill_sending() -> None:
    """Rank 2 (node 1's first rank) SIGKILLs itself as it reads the second file of its part of step
    CONFIG["kill_step"] to send (its rank file sent and renamed at rank 0, the index never written):
    the window where a half part lies in node 0's replica folder. The others stop with a typed error."""
    from lazyckpt.cluster import _wire

    if RANK == 2:
        real_run = _wire.Link.run

        def run(self, dst, header, files, src, sink_for):
            if header and header.get("step") == CONFIG["kill_step"] and len(files) >= 2:
                files = [files[0], DiesOnRead(files[1]), *files[2:]]
            return real_run(self, dst, header, files, src, sink_for)

        _wire.Link.run = run
    train_until_a_peer_dies()


def train_until_a_peer_dies() -> None:
    """Train past CONFIG["kill_step"]: a rank that dies there makes this one stop with a typed error."""
    ckpt = DistributedCheckpointer(levels=levels(), **options())
    try:
        handles = train(ckpt, 1, CONFIG["kill_step"] + 4)
        for h in handles.values():
            h.wait()
        ckpt.wait()
        raise AssertionError("training went on although a peer died")
    except (RuntimeError, DistributedLevelError, TimeoutError) as exc:  # gloo: the peers are gone
        RESULT["stopped_by"] = f"{type(exc).__name__}: {exc}"[:500]


def init() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    dist.init_process_group("gloo", rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60))


if __name__ == "__main__":
    _worker.run(ARGS, globals(), RESULT, init)
