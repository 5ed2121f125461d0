"""One process of the FSDP ``SHARDED_STATE_DICT`` tests of ``lazyckpt.accelerate`` (issue 14).

Usage: fsdp_sharded_worker.py SCENARIO RANK WORLD PORT WORKDIR (see tests/_worker.py). Writes
WORKDIR/result-<rank>.json ({"ok": true, ...} or {"ok": false, "error": ...}) and exits with os._exit.

Accelerate 1.15 does not enter FSDP mode on CPU, so the CPU scenarios build the FSDP2 model
themselves (``fully_shard``) next to a real ``Accelerator`` (MULTI_CPU, gloo) that has lazyckpt
installed, and call accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` (what
``save_state`` calls in FSDP mode) and ``load_fsdp_model`` / ``load_fsdp_optimizer``. The ``gpu``
scenario runs a real FSDP Accelerator (``save_state`` / ``load_state``) on CUDA.
"""

from __future__ import annotations

import errno
import os
import threading

import _worker

ARGS = _worker.parse_argv()
SCENARIO, RANK, WORLD, PORT, WORKDIR = ARGS
os.environ.update(
    MASTER_ADDR="127.0.0.1",
    MASTER_PORT=PORT,
    RANK=str(RANK),
    LOCAL_RANK=str(RANK),
    WORLD_SIZE=str(WORLD),
    LOCAL_WORLD_SIZE=str(WORLD),
)

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import FullyShardedDataParallelPlugin, fsdp_utils  # noqa: E402

import lazyckpt.accelerate  # noqa: E402
from _util import fsdp_model, full_dump, rank_step  # noqa: E402
from _util import same_state as same  # noqa: E402
from lazyckpt.distributed import DistributedSaveError  # noqa: E402

RESULT: dict = {"ok": True}
OPTS = dict(host_memory_budget=8 << 20, chunk_bytes=1 << 20, writer_threads=2)
WIDTH = 16


def plugin() -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, seed: int, device: str = "cpu") -> None:
    rank_step(model, opt, seed, WIDTH, device)


def listing(folder: str) -> list[str]:
    return sorted(os.listdir(folder)) if os.path.isdir(folder) else []


def sub_folders(out: str) -> dict[str, list[str]]:
    """What the model and optimizer sub-folders of a save_state folder hold."""
    return {d: listing(os.path.join(out, d)) for d in ("pytorch_model_fsdp_0", "optimizer_0")}


def record_loaded(loaded: dict, dump: dict) -> None:
    RESULT["model_equal"] = same(loaded["model"], dump["model"])
    RESULT["optim_equal"] = same(loaded["optim"], dump["optim"])


def save_state_while_training(acc, model, opt, device: str = "cpu", marker: bool = False) -> None:
    """Two steps, install lazyckpt, then ``save_state`` with every data write held: what the folder
    holds then (``during``); three more steps; the writes go; what it holds once the handle is done
    (``after``); ``load_state`` must restore the state at the save. ``marker``: whether the folder
    counts as complete during and after (after the other process's marker is gone too)."""
    for s in range(2):
        train_step(model, opt, s, device)
    handle = lazyckpt.accelerate.install(acc, **OPTS)
    dump = full_dump(model, opt.optimizer)
    release = hold_data_writes()
    out = os.path.join(WORKDIR, "ckpt")
    acc.save_state(out)
    RESULT["during"] = sub_folders(out)
    RESULT["during_out"] = listing(out)
    if marker:
        RESULT["complete_during"] = lazyckpt.accelerate.is_complete(out)
    for s in range(2, 5):
        train_step(model, opt, s, device)
    release.set()
    handle.wait()
    if marker:
        acc.wait_for_everyone()  # the other process's marker is gone too
    RESULT["after"] = sub_folders(out)
    RESULT["out"] = listing(out)
    if marker:
        RESULT["complete_after"] = lazyckpt.accelerate.is_complete(out)
    acc.load_state(out)
    record_loaded(full_dump(model, opt.optimizer), dump)
    handle.uninstall()


def hold_data_writes() -> threading.Event:
    """Hold this process's checkpoint data writes (lazyckpt's pwrite) until the event is set:
    forces the window in which stock dcp.save would have finished and a lazy save has not."""
    import lazyckpt.storage.fs as _fs

    real = _fs.pwrite_all
    release = threading.Event()

    def held(fd, data, offset):
        release.wait(60)
        return real(fd, data, offset)

    _fs.pwrite_all = held
    return release


def fail_data_writes() -> None:
    import lazyckpt.storage.fs as _fs

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    _fs.pwrite_all = enospc


def scenario_routed() -> None:
    """save_fsdp_model / save_fsdp_optimizer return before anything is written (writes held), the
    training steps on, then the folders are committed whole by lazyckpt and accelerate's stock
    load functions restore exactly the state at the save."""
    acc = Accelerator(cpu=True)
    RESULT["distributed_type"] = str(acc.distributed_type)
    model, opt = fsdp_model()
    for s in range(2):
        train_step(model, opt, s)
    fsdp = plugin()
    out = os.path.join(WORKDIR, "ckpt")
    handle = lazyckpt.accelerate.install(acc, **OPTS)
    dump = full_dump(model, opt)
    release = hold_data_writes()
    fsdp_utils.save_fsdp_model(fsdp, acc, model, out)
    fsdp_utils.save_fsdp_optimizer(fsdp, acc, opt, model, out)
    RESULT["during"] = sub_folders(out)
    RESULT["offload_restored"] = fsdp.state_dict_config.offload_to_cpu is True
    for s in range(2, 5):  # the first step waits for this process's pending copies only
        train_step(model, opt, s)
    release.set()
    handle.wait()
    RESULT["after"] = sub_folders(out)
    RESULT["out"] = listing(out)
    moved = full_dump(model, opt)
    RESULT["trained_on"] = not same(moved["model"], dump["model"])
    acc.wait_for_everyone()
    fsdp_utils.load_fsdp_model(fsdp, acc, model, out)
    fsdp_utils.load_fsdp_optimizer(fsdp, acc, opt, model, out)
    record_loaded(full_dump(model, opt), dump)
    # a dcp.save outside accelerate's functions, and accelerate's after uninstall(), are stock
    import torch.distributed.checkpoint as dcp

    plain = os.path.join(WORKDIR, "plain")
    dcp.save({"x": torch.ones(4)}, storage_writer=dcp.FileSystemWriter(plain))
    RESULT["plain"] = listing(plain)
    handle.uninstall()
    fsdp_utils.save_fsdp_model(fsdp, acc, model, os.path.join(WORKDIR, "stock"))
    RESULT["stock"] = listing(os.path.join(WORKDIR, "stock", "pytorch_model_fsdp_0"))
    acc.wait_for_everyone()


def scenario_write_error() -> None:
    """Process 1's data writes fail during the optimizer save: handle.wait() raises on both
    processes, naming process 1; the model folder is committed, the optimizer folder is not."""
    acc = Accelerator(cpu=True)
    model, opt = fsdp_model()
    train_step(model, opt, 0)
    fsdp = plugin()
    out = os.path.join(WORKDIR, "ckpt")
    handle = lazyckpt.accelerate.install(acc, **OPTS)
    fsdp_utils.save_fsdp_model(fsdp, acc, model, out)
    handle.wait()
    if RANK == 1:
        fail_data_writes()
    fsdp_utils.save_fsdp_optimizer(fsdp, acc, opt, model, out)
    train_step(model, opt, 1)
    try:
        handle.wait()
        RESULT["raised"] = None
    except DistributedSaveError as exc:
        RESULT["raised"] = type(exc).__name__
        RESULT["ranks"] = list(exc.ranks)
    RESULT["model"] = listing(os.path.join(out, "pytorch_model_fsdp_0"))
    RESULT["optimizer"] = listing(os.path.join(out, "optimizer_0"))
    handle.wait()  # reported once
    handle.uninstall()
    acc.wait_for_everyone()


def scenario_save_state_forced() -> None:
    """The whole save_state / load_state path on CPU by forcing the accelerator into FSDP mode
    (accelerate itself never does that on CPU): a stand-in for the GPU run, not a user setup. The
    folder stays marked incomplete until the sharded sub-folders are committed."""
    from accelerate.utils import DistributedType

    acc = Accelerator(cpu=True)
    model, opt = fsdp_model()
    acc._models.append(model)  # what prepare() registers (it would wrap the model in DDP here)
    opt = acc.prepare_optimizer(opt)
    acc.state.distributed_type = DistributedType.FSDP
    acc.state.fsdp_plugin = plugin()
    save_state_while_training(acc, model, opt, marker=True)
    acc.wait_for_everyone()


def scenario_gpu() -> None:
    """A real FSDP Accelerator on CUDA (``ACCELERATE_USE_FSDP``): save_state is lazy, load_state
    restores the state at the save (GPU only: accelerate refuses FSDP on CPU)."""
    acc = Accelerator(fsdp_plugin=plugin())
    RESULT["distributed_type"] = str(acc.distributed_type)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU(), torch.nn.Linear(WIDTH, WIDTH))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, opt = acc.prepare(model, opt)
    save_state_while_training(acc, model, opt, "cuda")


if __name__ == "__main__":
    _worker.run(ARGS, globals(), RESULT)
