"""One rank of a multi-process DistributedCheckpointer test (CPU, gloo).

Usage: dist_worker.py SCENARIO RANK WORLD PORT WORKDIR (see tests/_worker.py). Writes
WORKDIR/result-<rank>.json ({"ok": true, ...} or {"ok": false, "error": ...}) and exits with os._exit.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import _worker
from _util import bitwise_tensors, clone, fsdp_model, full_dump, mlp, rank_step, walk_state
from lazyckpt.core.job import Stage
from lazyckpt.distributed import DistributedCheckpointer, DistributedSaveError, verify_checkpoint

ARGS = _worker.parse_argv()
SCENARIO, RANK, WORLD, PORT, WORKDIR = ARGS
RESULT: dict = {"ok": True}
OPTS = dict(host_memory_budget=8 << 20, chunk_bytes=1 << 20, writer_threads=2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int, width: int = 16) -> None:
    rank_step(model, opt, seed, width)


def compare(a, b, where: str = "") -> None:
    """Bitwise equality of nested state; raises AssertionError naming the first difference."""
    walk_state(a, b, where, bitwise_tensors)


def wait_fails(h, error: type[DistributedSaveError] = DistributedSaveError) -> DistributedSaveError:
    """``h.wait()`` must raise ``error``: the ranks it names, its message and the seconds waited go to RESULT."""
    t = time.monotonic()
    try:
        h.wait()
    except error as exc:
        RESULT.update(ranks=list(exc.ranks), message=str(exc), waited_s=time.monotonic() - t)
        return exc
    raise AssertionError("wait() should have failed")


def ckpt_path(name: str) -> str:
    return os.path.join(WORKDIR, "ckpt", name)


def hold_staging_until_the_step() -> dict:
    """Hold the stager until an optimizer step's guard is entered (at most 10 s: never hang), so
    that the step must find this rank's copies pending and wait for them."""
    import threading

    import lazyckpt.core.engine as engine
    import lazyckpt.core.job as job_mod

    gate, seen = threading.Event(), {}
    real_stage, real_release = engine.Engine._stage, job_mod.Job.release_guard

    def held_stage(self, job):
        gate.wait(10)
        real_stage(self, job)

    def release_guard(self):
        seen.setdefault("staged", self.stage >= job_mod.Stage.CPU_STAGED)
        gate.set()
        real_release(self)

    engine.Engine._stage = held_stage
    job_mod.Job.release_guard = release_guard
    return seen


# -- scenarios ---------------------------------------------------------------------------------------


def scenario_fsdp() -> None:
    """FSDP2 + AdamW: save, step at once (the guard), wait; stock dcp.load into a fresh model and
    optimizer must give the state at save() bitwise; a dump for the single-process checks."""
    fsdp_round_trip(ckpt_path("step-2"), OPTS)


def s3_test_config() -> tuple[str, dict, dict]:
    """(bucket, storage options, storage options through the fault proxy) from the test process."""
    config = json.loads(os.environ["LAZYCKPT_TEST_S3"])
    return config["bucket"], config["options"], config["proxy_options"]


def scenario_fsdp_s3() -> None:
    """scenario_fsdp to s3:// (moto): every rank uploads its file, .metadata last; stock dcp.load
    through FsspecReader on both ranks."""
    bucket, options, _ = s3_test_config()
    opts = dict(OPTS, storage_options=options, local_dir=os.path.join(WORKDIR, f"tier-{RANK}"))
    fsdp_round_trip(f"s3://{bucket}/run/step-2", opts, reader_options=options)
    RESULT["local_tier"] = sorted(os.listdir(os.path.join(WORKDIR, f"tier-{RANK}")))


def fsdp_round_trip(path: str, opts: dict, reader_options: dict | None = None) -> None:
    model, opt = fsdp_model()
    for step in range(2):
        train_step(model, opt, step)
    dump = full_dump(model, opt)
    seen = hold_staging_until_the_step()
    with DistributedCheckpointer(**opts) as ckpt:
        msd, osd = get_state_dict(model, opt)
        h = ckpt.save({"model": msd, "optim": osd, "step": 2}, path)
        RESULT["staged_after_save"] = h.staged()
        for step in range(2, 4):  # the first step right after save(): it waits for this rank's copies
            train_step(model, opt, step)
        stats = h.wait()
        RESULT["guard_wait_s"] = stats.guard_wait_s
    RESULT["staged_when_step_began"] = seen.get("staged")
    assert not torch.equal(full_dump(model, opt)["model"]["0.weight"], dump["model"]["0.weight"]), "training moved on"
    fresh, fresh_opt = fsdp_model()
    train_step(fresh, fresh_opt, 99)  # optimizer state exists, with other values
    msd, osd = get_state_dict(fresh, fresh_opt)
    state = {"model": msd, "optim": osd, "step": -1}
    if reader_options is None:
        dcp.load(state, checkpoint_id=path)
    else:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader

        dcp.load(state, storage_reader=FsspecReader(path, **reader_options))
    set_state_dict(fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert state["step"] == 2
    compare(full_dump(fresh, fresh_opt), dump, "loaded")
    if RANK == 0:
        torch.save(dump, os.path.join(WORKDIR, "dump.pt"))


def scenario_s3_upload_fails() -> None:
    """A committed checkpoint at run/good, then a save to run/bad whose rank 1 uploads through the
    fault proxy, which answers 500 to every PUT under run/bad/ (rank 1's file is a multipart
    upload): both ranks fail with DistributedUploadError naming rank 1; nothing at run/bad. Then
    run/good saved again with other values."""
    import lazyckpt.storage.objects as remote
    from lazyckpt import UploadError
    from lazyckpt.distributed import DistributedUploadError

    remote._BACKOFF_S = 0.01
    bucket, options, proxy_options = s3_test_config()
    opts = dict(
        OPTS, storage_options=options if RANK == 0 else proxy_options, upload_retries=1,
        upload_part_bytes=5 << 20, local_dir=os.path.join(WORKDIR, f"tier-{RANK}"),
    )  # fmt: skip
    own = torch.randn((12 << 20) // 4 if RANK == 1 else 100)  # rank 1: three 5 MiB parts
    state = {"w": torch.arange(4096.0), f"own{RANK}": own}
    with DistributedCheckpointer(commit_timeout=60, **opts) as ckpt:
        ckpt.save(state, f"s3://{bucket}/run/good").wait()
        exc = wait_fails(ckpt.save(state, f"s3://{bucket}/run/bad"), DistributedUploadError)
        assert isinstance(exc, UploadError) and isinstance(exc, DistributedSaveError)
        RESULT.update(cause=type(exc.__cause__).__name__, local_path=exc.local_path)
        RESULT["kept"] = sorted(os.listdir(exc.local_path)) if exc.local_path else None
        state = {"w": torch.arange(4096.0) + 1, f"own{RANK}": own + 1}
        ckpt.save(state, f"s3://{bucket}/run/good").wait()  # the same prefix again: replaced whole
    if RANK == 0:
        torch.save(state, os.path.join(WORKDIR, "good.pt"))


def scenario_s3_sigkill() -> None:
    """A committed checkpoint at run/good, then a save to run/killed during which rank 1 is
    SIGKILLed mid multipart upload (before its part 2): rank 0 fails within commit_timeout, no
    .metadata appears at run/killed, and run/good stays intact."""
    import lazyckpt.storage.objects as remote

    bucket, options, _ = s3_test_config()
    opts = dict(OPTS, storage_options=options, upload_part_bytes=5 << 20, local_dir=os.path.join(WORKDIR, f"t{RANK}"))
    state = {"w": torch.arange(4096.0), f"own{RANK}": torch.randn((12 << 20) // 4 if RANK == 1 else 100)}
    ckpt = DistributedCheckpointer(commit_timeout=3.0, **opts)
    ckpt.save(state, f"s3://{bucket}/run/good").wait()
    if RANK == 1:
        real_part = remote.S3Upload._part

        def part(self, fd, upload_id, number, offset, nbytes):
            if number == 2:
                os.kill(os.getpid(), signal.SIGKILL)
            return real_part(self, fd, upload_id, number, offset, nbytes)

        remote.S3Upload._part = part
    wait_fails(ckpt.save(state, f"s3://{bucket}/run/killed"))
    if RANK == 0:
        torch.save(state, os.path.join(WORKDIR, "good.pt"))


def scenario_load_fsdp() -> None:
    """Load a checkpoint saved by another world size into FSDP2 here (resharding) and compare."""
    model, opt = fsdp_model()
    train_step(model, opt, 99)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": -1}
    dcp.load(state, checkpoint_id=ckpt_path("step-2"))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    compare(full_dump(model, opt), torch.load(os.path.join(WORKDIR, "dump.pt"), weights_only=False), "resharded")


def scenario_ddp() -> None:
    """Replicated state (DDP-style): every tensor written once, the bytes spread across ranks."""
    model = mlp(width=32, depth=6)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    train_step(model, opt, 0, width=32)  # rank-dependent gradients: make the replicas equal again
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    for state in opt.state.values():
        for v in state.values():
            if isinstance(v, torch.Tensor) and v.dim():
                dist.broadcast(v, src=0)
    dump = clone({"model": model.state_dict(), "optim": opt.state_dict()})
    with DistributedCheckpointer(**OPTS) as ckpt:
        h = ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, ckpt_path("ddp"))
        train_step(model, opt, 1, width=32)  # the step waits for this rank's copies first
        h.wait()
    if RANK == 0:
        torch.save(dump, os.path.join(WORKDIR, "dump.pt"))


def scenario_tp() -> None:
    """A tensor-parallel pair of layers (DTensor, colwise then rowwise)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (WORLD,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8))
    model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)  # the same input on every rank (tensor parallel)
    for _ in range(2):
        model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
    dump = full_dump(model, opt)
    with DistributedCheckpointer(**OPTS) as ckpt:
        msd, osd = get_state_dict(model, opt)
        h = ckpt.save({"model": msd, "optim": osd}, ckpt_path("tp"))
        model(torch.randn(4, 8, generator=g)).pow(2).sum().backward()
        opt.step()
        h.wait()
    if RANK == 0:
        torch.save(dump, os.path.join(WORKDIR, "dump.pt"))


def scenario_uneven() -> None:
    """Rank 0 holds 3 MiB (more than its 1 MiB host budget: it streams), rank 1 a few bytes; the
    rank with little to write waits for the other, within commit_timeout."""
    torch.manual_seed(RANK)
    state = {f"rank{RANK}.t": torch.randn(768 * 1024 if RANK == 0 else 3), "common": {"lr": 0.5}}
    dump = clone(state)
    opts = dict(OPTS, host_memory_budget=1 << 20, chunk_bytes=256 << 10)
    with DistributedCheckpointer(commit_timeout=60, **opts) as ckpt:
        ckpt.save(state, ckpt_path("uneven")).wait()
    torch.save(dump, os.path.join(WORKDIR, f"dump-{RANK}.pt"))


def _patch_data_writes(action) -> None:
    """Make this rank's first tensor-data pwrite of a .distcp file call ``action`` instead."""
    import lazyckpt.storage.fs as _fs

    real = _fs.pwrite_all

    def pwrite_all(fd, data, offset):
        if len(data) >= 1024:
            action()
        return real(fd, data, offset)

    _fs.pwrite_all = pwrite_all


def scenario_write_error() -> None:
    """Rank 1 hits ENOSPC writing its data: both ranks' wait() fail naming rank 1; nothing at the
    final name, no staging folder left."""
    state = {"w": torch.randn(64, 64), f"own{RANK}": torch.randn(512)}
    with DistributedCheckpointer(**OPTS) as ckpt:
        if RANK == 1:

            def enospc():
                raise OSError(errno.ENOSPC, "No space left on device (injected)")

            _patch_data_writes(enospc)
        exc = wait_fails(ckpt.save(state, ckpt_path("bad")))
        RESULT.update(cause=type(exc.__cause__).__name__, errno=exc.errno)
        dist.barrier()
    RESULT["exists"] = os.path.exists(ckpt_path("bad"))
    RESULT["listing"] = sorted(os.listdir(os.path.dirname(ckpt_path("bad"))))


def scenario_memory_fs_full() -> None:
    """On a memory filesystem, rank 1's disk is full when its file is created (inside save() when it
    writes the file itself, else by a writer): save() returns on both ranks (it raises only SaveRefusedError), and both
    ranks' handle.wait() and wait() raise the same DistributedSaveError naming rank 1."""
    import lazyckpt.storage.fs as _fs
    from lazyckpt import SaveRefusedError, WriteError

    folder = os.environ["LAZYCKPT_TEST_SHM"]
    assert _fs.is_memory_filesystem(folder)
    state = {"w": torch.randn(64, 64), f"own{RANK}": torch.randn(512)}
    created_in_save = []
    with DistributedCheckpointer(**OPTS) as ckpt:
        if RANK == 1:
            real = _fs.open_temporary

            def full(path, size):
                created_in_save.append(True)
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)

            _fs.open_temporary = full
        try:
            h = ckpt.save(state, os.path.join(folder, "full"))
        except (SaveRefusedError, WriteError) as exc:
            RESULT["save_raised"] = f"{type(exc).__name__}: {exc}"
            raise
        RESULT["save_raised"] = None
        for name, call in (("handle", h.wait), ("wait", ckpt.wait)):
            try:
                call()
                RESULT[name] = None
            except DistributedSaveError as exc:
                RESULT[name] = {
                    "type": type(exc).__name__, "ranks": list(exc.ranks), "message": str(exc),
                    "cause": type(exc.__cause__).__name__, "errno": getattr(exc.__cause__, "errno", None),
                }  # fmt: skip
        if RANK == 1:  # the file is created in save() or by a writer: restored once the save ended
            _fs.open_temporary = real
        RESULT["created_in_save"] = bool(created_in_save)
        dist.barrier()
        ckpt.save(state, os.path.join(folder, "ok")).wait()  # usable again
    RESULT["listing"] = sorted(os.listdir(folder))


def scenario_subgroup() -> None:
    """process_group: ranks 1 and 2 save together (group ranks 0 and 1); rank 0 takes no part."""
    group = dist.new_group([1, 2], backend="gloo")
    if RANK != 0:
        state = {"shared": torch.arange(64.0), f"own{RANK}": torch.full((8,), float(RANK))}
        with DistributedCheckpointer(process_group=group, **OPTS) as ckpt:
            ckpt.save(state, ckpt_path("sub")).wait()
    dist.barrier()  # rank 0 hosts the store: it stays until the others are done


def scenario_coordinator_exits_at_once() -> None:
    """Rank 0 (which hosts the store) exits right after its wait() returns, while rank 1 has not yet
    read the outcome (its read is held until rank 0 either returned from wait() or is waiting for
    the others' acknowledgments): rank 1's save must still succeed."""
    from lazyckpt.distributed._commit import StoreProtocol

    store = dist.distributed_c10d._get_default_store()
    if RANK == 0:
        real_wait_acks = getattr(StoreProtocol, "wait_acks", None)

        def wait_acks(self, *args):
            store.set("test/coordinator-progressed", "1")  # waiting for the others' acknowledgments
            return real_wait_acks(self, *args)

        StoreProtocol.wait_acks = wait_acks
    else:
        real_wait_value = StoreProtocol.wait_value

        def wait_value(self, *args):
            store.wait(["test/coordinator-progressed"])  # set by the other process
            return real_wait_value(self, *args)

        StoreProtocol.wait_value = wait_value
    ckpt = DistributedCheckpointer(**OPTS)
    ckpt.save({"w": torch.ones(256), f"own{RANK}": torch.ones(8)}, ckpt_path("fast")).wait()
    if RANK == 0:
        store.set("test/coordinator-progressed", "1")  # returned; main() exits with os._exit right after


def scenario_peer_gone_before_save() -> None:
    """Rank 1 exits before the save: rank 0's planning collective fails, and save() raises the
    channel's own RuntimeError (a dead peer), not SaveRefusedError (a refusal of the state or path)."""
    ckpt = DistributedCheckpointer(**OPTS)
    dist.barrier()
    if RANK == 1:
        os._exit(0)
    try:
        ckpt.save({"w": torch.ones(8)}, ckpt_path("gone")).wait()
        RESULT["raised"] = None
    except Exception as exc:
        RESULT["raised"] = type(exc).__name__
        RESULT["runtime"] = isinstance(exc, RuntimeError)
    RESULT["exists"] = os.path.exists(ckpt_path("gone"))


def scenario_refusals() -> None:
    """(a) rank 1 cannot serialize a value: SaveRefusedError there, DistributedSaveError naming rank 1
    on rank 0; (b) the coordinator refuses the path (a file): planning fails on every rank;
    (c) the checkpointer still works."""
    from lazyckpt import SaveRefusedError

    with DistributedCheckpointer(commit_timeout=30, **OPTS) as ckpt:
        state = {"w": torch.ones(8), "hook": (lambda: 0) if RANK == 1 else 0}
        try:
            ckpt.save(state, ckpt_path("a")).wait()
            RESULT["a"] = "ok"
        except SaveRefusedError as exc:
            RESULT["a"] = f"refused: {exc}"
        except DistributedSaveError as exc:
            RESULT["a"] = f"failed {list(exc.ranks)}: {exc}"
        if RANK == 0:  # only the coordinator looks at the path: its refusal reaches every rank
            with open(ckpt_path("b"), "w") as fh:
                fh.write("a file, not a folder")
        dist.barrier()
        try:
            ckpt.save({"w": torch.ones(8)}, ckpt_path("b"))
            RESULT["b"] = "ok"
        except SaveRefusedError as exc:
            RESULT["b"] = f"refused: {exc}"
        ckpt.save({"w": torch.ones(8)}, ckpt_path("c")).wait()
    RESULT["listing"] = sorted(os.listdir(os.path.dirname(ckpt_path("c"))))


def scenario_slow_rank() -> None:
    """Rank 1's file is not durable within commit_timeout (its finalisation is held until the
    coordinator has decided): both ranks fail, naming rank 1; nothing appears, nothing is left."""
    import lazyckpt.core.engine as engine

    store = dist.distributed_c10d._get_default_store()
    ckpt = DistributedCheckpointer(commit_timeout=1.0, **OPTS)
    if RANK == 1:
        real_finalize = engine.Engine._finalize
        outcome_key = f"lazyckpt/{ckpt._token}/0/outcome"

        def held_finalize(self, job):
            try:
                store.wait([outcome_key], timedelta(seconds=30))  # the other process decides
            except RuntimeError:  # never hang the test: finalize late instead
                pass
            real_finalize(self, job)

        engine.Engine._finalize = held_finalize
    wait_fails(ckpt.save({"w": torch.ones(64), f"own{RANK}": torch.ones(8)}, ckpt_path("slow")))
    dist.barrier()
    RESULT["listing"] = sorted(os.listdir(os.path.dirname(ckpt_path("slow"))))
    try:
        ckpt.close()
    except DistributedSaveError:
        pass


def scenario_lone_waiter() -> None:
    """Rank 0 waits for the commit alone, before its next forward pass; rank 1 goes straight into
    its forward pass, whose FSDP all-gather waits for rank 0. Rank 1's copies are over before that
    forward begins, and it calls nothing of lazyckpt's: the only way its file gets confirmed, so that
    the save can commit and rank 0's wait() can return, is the forward pre-hook. Without it, rank 0
    waits until commit_timeout and the save fails."""
    model, opt = fsdp_model()
    train_step(model, opt, 0)
    ckpt = DistributedCheckpointer(commit_timeout=20.0, **OPTS)
    msd, osd = get_state_dict(model, opt)
    h = ckpt.save({"model": msd, "optim": osd}, ckpt_path("lone"))
    t = time.monotonic()
    if RANK == 0:
        h.wait()
        RESULT["waited_s"] = time.monotonic() - t
    else:
        job = ckpt._inner._pending.jobs()[-1]
        assert job.wait_for(Stage.READ, 30), "copies not over"
        RESULT["confirmed_before_forward"] = job.stage is Stage.CONFIRMED
    train_step(model, opt, 1)
    ckpt.close()
    RESULT["verified"] = verify_checkpoint(ckpt_path("lone")).ok


def killed_mid_write(killed: int, commit_timeout: float, good_first: bool = False) -> None:
    """A save to ckpt/killed during which rank ``killed`` is SIGKILLed at its first data write: the
    others' wait() must fail (``wait_fails``); then whether the final name exists, and the folder's
    listing. ``good_first``: a committed checkpoint at ckpt/good before."""
    state = {"w": torch.randn(64, 64), f"own{RANK}": torch.randn(4096)}
    ckpt = DistributedCheckpointer(commit_timeout=commit_timeout, **OPTS)
    if good_first:
        ckpt.save(state, ckpt_path("good")).wait()
    if killed == RANK:
        _patch_data_writes(lambda: os.kill(os.getpid(), signal.SIGKILL))
    wait_fails(ckpt.save(state, ckpt_path("killed")))
    RESULT["exists"] = os.path.exists(ckpt_path("killed"))
    RESULT["listing"] = sorted(os.listdir(os.path.dirname(ckpt_path("killed"))))


def scenario_sigkill_coordinator() -> None:
    """The coordinator (rank 0, which also hosts the store) is SIGKILLed mid-write: rank 1's wait()
    fails (typed) well within commit_timeout; its staging folder is left for the next save."""
    killed_mid_write(0, commit_timeout=30.0)


def scenario_save_after_crash() -> None:
    """A new job's first save into the folder of a crashed one removes the crashed save's staging."""
    with DistributedCheckpointer(**OPTS) as ckpt:
        ckpt.save({"w": torch.ones(4)}, ckpt_path("next")).wait()
    RESULT["listing"] = sorted(os.listdir(os.path.dirname(ckpt_path("next"))))


def scenario_sigkill() -> None:
    """A committed checkpoint, then a save during which rank 1 is SIGKILLed mid-write: rank 0's
    wait() fails within commit_timeout; the new name never appears; the old checkpoint stays."""
    killed_mid_write(1, commit_timeout=3.0, good_first=True)


def scenario_sigkill_detected() -> None:
    """Rank 1 is SIGKILLed mid-write; commit_timeout is 120 s: rank 0's wait() fails naming rank 1
    as soon as its heartbeat has stopped (seconds), not after commit_timeout."""
    killed_mid_write(1, commit_timeout=120.0)


def scenario_sigkill_coordinator_detected() -> None:
    """As scenario_sigkill_coordinator, but the store outlives rank 0 (hosted by the test process,
    as torchrun's agent hosts it): rank 1 learns of the death from rank 0's stopped heartbeat and
    fails naming rank 0, well within commit_timeout (120 s)."""
    killed_mid_write(0, commit_timeout=120.0)


def scenario_slow_alive_rank() -> None:
    """Rank 1's file is held (its finalisation waits on an Event) for three times the time after
    which a silent rank counts as dead, well within commit_timeout (60 s): rank 1 is alive (its
    heartbeat runs), so the save commits on both ranks."""
    import threading

    import lazyckpt.core.engine as engine
    from lazyckpt.distributed import _commit

    _commit.DEAD_AFTER_S = 1.0  # on both ranks: a false "dead" would show within the hold
    ckpt = DistributedCheckpointer(commit_timeout=60.0, **OPTS)
    if RANK == 1:
        real_finalize = engine.Engine._finalize
        never_set = threading.Event()

        def held_finalize(self, job):
            never_set.wait(3 * _commit.DEAD_AFTER_S)  # slow, not dead: bounded
            real_finalize(self, job)

        engine.Engine._finalize = held_finalize
    t = time.monotonic()
    ckpt.save({"w": torch.ones(64), f"own{RANK}": torch.ones(8)}, ckpt_path("slow")).wait()
    RESULT["waited_s"] = time.monotonic() - t
    ckpt.close()
    RESULT["verified"] = verify_checkpoint(ckpt_path("slow")).ok


def init() -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=PORT)
    store_port = os.environ.get("LAZYCKPT_TEST_STORE_PORT")
    if store_port:  # the store is hosted by the test process (as torchrun's agent hosts it)
        os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
        store = dist.TCPStore("127.0.0.1", int(store_port), WORLD, is_master=False, timeout=timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60))
    else:
        dist.init_process_group("gloo", rank=RANK, world_size=WORLD, timeout=timedelta(seconds=60))


if __name__ == "__main__":
    _worker.run(ARGS, globals(), RESULT, init)
