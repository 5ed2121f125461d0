"""Run by tests/test_lightning_levels_sharded.py: ``python levels_sharded.py OUT PHASE`` with tests/ and
the repository root on PYTHONPATH. Lightning's subprocess launcher re-runs this script for rank 1:
``ModelParallelStrategy`` (FSDP2 ``fully_shard`` in ``configure_model``), ``accelerator="cpu",
devices=2``; a phase that calls ``lazyckpt.latest`` before its first fit does so with
torch.distributed not initialized, as a user's script does.

Each rank's batch comes from (epoch, batch index, rank), which a stock resume restores, so a fit
resumed mid-epoch sees the data an uninterrupted one sees. Levels: OUT/mem (every step, keep 2),
OUT/disk (every 3, keep 2).

Stock Lightning's own resume of a ModelParallel fit does not continue its uninterrupted run bit for
bit here (measured: Lightning 2.6.6, torch 2.13, CPU, with no lazyckpt in the process: ~1e-2 apart
after three more steps), so the references are stock runs: stock folders saved by ModelCheckpoint
at every step, and stock resumes from them.

Phases (each a fresh launch; rank 0 writes OUT/<name>-end.pt, the final full state of each fit):

- ``stock``: no lazyckpt at all. A fit to STEPS saving OUT/stock/step<n>.ckpt at every step; a
  resume from its step 5 saving OUT/stock5/step<n>.ckpt (``stock-from5``); resumes to STEPS from
  that one's step 6 (``stock-from5-6``) and from the first one's step 3 (``stock-from3``).
- ``first``: a fit with the levels to step 5.
- ``resume``: ``found = latest(levels)``, then ``fit(ckpt_path=found.path)`` to STEPS.
- ``wiped`` (the test removed OUT/mem): the same (``wiped``); then a fit without lazyckpt from the
  disk level's step-3 folder (``plain3``).
- ``enospc``: every write of rank 1 into OUT/disk fails with ENOSPC, and rank 1 learns of the first
  failure only once it settles its level saves (rank 0 knows first); fit to STEPS.

Every rank writes OUT/<phase>-rank<r>.json: what it found, its global step, what ``fit`` raised.
"""

from __future__ import annotations

import errno
import json
import os
import sys
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

import lazyckpt
from _util import run_then_exit
from lazyckpt import Level
from lazyckpt.lightning import LazyCheckpointIO, MultiLevelCheckpoint

STEPS = 8
RANK = int(os.environ.get("LOCAL_RANK", "0"))
LAST: list[L.Trainer] = []  # the newest Trainer made by fit()


class StepMLP(L.LightningModule):
    """A small MLP, FSDP2 ``fully_shard`` per layer in ``configure_model``; AdamW with a per-step
    schedule. Each rank's batch comes from (epoch, batch index, rank)."""

    def __init__(self) -> None:
        super().__init__()
        self.net: nn.Module | None = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.net is not None:
            return
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.LayerNorm(64), nn.Linear(64, 64), nn.GELU(),
                                 nn.Linear(64, 8))  # fmt: skip
        for layer in (self.net[0], self.net[3], self.net[5]):
            fully_shard(layer, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * self.current_epoch + 10 * batch_idx + self.global_rank)
        x, y = torch.randn(4, 32, generator=g), torch.randn(4, 8, generator=g)
        assert self.net is not None
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader:  # 4 batches per rank: the lengths only
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(16, 1)), batch_size=2)


def final_state(trainer: L.Trainer, module: StepMLP) -> dict[str, Any]:
    """The whole state, gathered (a collective): weights, optimizer, schedulers, global step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    assert module.net is not None
    msd, osd = get_state_dict(module.net, trainer.optimizers[0], options=StateDictOptions(full_state_dict=True))
    schedulers = [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
    return {"model": msd, "optim": osd, "lr_schedulers": schedulers, "step": trainer.global_step}


def levels(out: str) -> list[Level]:
    return [Level(os.path.join(out, "mem"), every=1, keep=2), Level(os.path.join(out, "disk"), every=3, keep=2)]


def fit(out: str, name: str, lv: list[Level] | None, steps: int, ckpt_path: str | None = None,
        callbacks: list[Any] | None = None) -> L.Trainer:  # fmt: skip
    """A fit with the levels (and the plugin), or a plain one without lazyckpt (``lv`` None)."""
    torch.manual_seed(0)
    callbacks = [*([MultiLevelCheckpoint(lv)] if lv is not None else []), *(callbacks or [])]
    trainer = L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=steps, max_epochs=None,
        plugins=[LazyCheckpointIO()] if lv is not None else [], callbacks=callbacks,
        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
        logger=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    module = StepMLP()
    LAST[:] = [trainer]
    trainer.fit(module, ckpt_path=ckpt_path)
    end = final_state(trainer, module)  # a collective: every rank
    if trainer.is_global_zero:
        torch.save(end, os.path.join(out, f"{name}-end.pt"))
    return trainer


def resume(out: str, name: str, report: dict[str, Any]) -> None:
    found = lazyckpt.latest(levels(out))  # before fit: torch.distributed not initialized yet
    report["initialized_at_latest"] = torch.distributed.is_initialized()
    report["found"] = None if found is None else [found.step, found.level, found.path]
    assert found is not None
    report["global_step"] = fit(out, name, levels(out), STEPS, ckpt_path=found.path).global_step


def every_step(folder: str) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=folder, filename="step{step}", auto_insert_metric_name=False, every_n_train_steps=1,
                           save_top_k=-1)  # fmt: skip


def phase_stock(out: str, report: dict[str, Any]) -> None:
    stock, stock5 = os.path.join(out, "stock"), os.path.join(out, "stock5")
    fit(out, "stock", None, STEPS, callbacks=[every_step(stock)])
    fit(out, "stock-from5", None, STEPS, ckpt_path=os.path.join(stock, "step5.ckpt"), callbacks=[every_step(stock5)])
    fit(out, "stock-from5-6", None, STEPS, ckpt_path=os.path.join(stock5, "step6.ckpt"))
    fit(out, "stock-from3", None, STEPS, ckpt_path=os.path.join(stock, "step3.ckpt"))


def phase_first(out: str, report: dict[str, Any]) -> None:
    report["global_step"] = fit(out, "first", levels(out), 5).global_step


def phase_replicas(out: str, report: dict[str, Any]) -> None:
    """Each rank stands for a node (its own memory folder, OUT/memr/node<rank>), replicas=1: every
    step's shards also held in the other rank's memory; to step 5, as ``first``."""
    own = [Level(os.path.join(out, "memr", f"node{RANK}"), every=1, keep=2, replicas=1),
           Level(os.path.join(out, "diskr"), every=3, keep=2)]  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        report["global_step"] = fit(out, "replicas", own, 5).global_step
    report["warnings"] = [f"{w.category.__name__}: {w.message}" for w in seen if "lazyckpt" in str(w.message)]


def phase_wiped(out: str, report: dict[str, Any]) -> None:
    resume(out, "wiped", report)
    fit(out, "plain3", None, STEPS, ckpt_path=os.path.join(out, "disk", "step-00000003"))


def phase_enospc(out: str, report: dict[str, Any]) -> None:
    from lazyckpt.storage import fs as _fs

    disk = os.path.join(out, "disk")
    if RANK == 1:
        real = _fs.open_temporary

        def full(path: str, size: int) -> int:
            if path.startswith(disk + os.sep):
                raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
            return real(path, size)

        _fs.open_temporary = full  # type: ignore[assignment]
        _hold_first_level_error_until_settled()
    try:
        fit(out, "enospc", [Level(os.path.join(out, "mem"), every=1, keep=2), Level(disk, every=2)], STEPS)
    finally:
        report["at_step"] = LAST[0].global_step if LAST else None


def _hold_first_level_error_until_settled() -> None:
    """Rank 1 learns of the disk level's first failure only once its training thread settles its
    level saves (``PluginLevels.drain``) or is to wait for the disk level's backlog, which the held
    part fills (without that release it waited out the bound, 120 s, in some runs): rank 0 knows
    first, so the ranks must agree to raise it together, each its own ``DistributedLevelError``.
    Bounded (a rank that never settles gets it later)."""
    import threading

    from lazyckpt.lightning import _levels
    from lazyckpt.schedule import _handle, _schedule

    settled = threading.Event()
    part_done, drain = _handle.Parts.part_done, _levels.PluginLevels.drain

    def held_part_done(self: Any, part: int, error: BaseException | None = None, written: bool = True) -> None:
        if part == 1 and error is not None and not settled.is_set():
            settled.wait(120)
        part_done(self, part, error, written)

    def settling_drain(self: Any, timeout: float | None = None) -> None:
        settled.set()
        drain(self, timeout)

    def settling_admit(self: Any, index: int, level: Any, step: int, skip: Any, confirm: Any, **kw: Any) -> bool:
        def confirm_and_settle() -> None:  # called when the training thread is to wait for a backlog place:
            settled.set()  # what it waits for (the held part) must be able to end, as without the hold
            confirm()

        return admit(self, index, level, step, skip, confirm_and_settle, **kw)

    admit = _schedule.Backlog.admit
    _handle.Parts.part_done = held_part_done  # type: ignore[method-assign]
    _levels.PluginLevels.drain = settling_drain  # type: ignore[method-assign]
    _schedule.Backlog.admit = settling_admit  # type: ignore[method-assign]


def main() -> None:
    out, phase = sys.argv[1], sys.argv[2]
    report: dict[str, Any] = {"rank": RANK, "raised": None}
    phases = {"stock": phase_stock, "first": phase_first, "resume": lambda o, r: resume(o, "resume", r),
              "wiped": phase_wiped, "enospc": phase_enospc, "replicas": phase_replicas}  # fmt: skip
    try:
        phases[phase](out, report)
    except BaseException as exc:
        report.update(raised=type(exc).__name__, message=str(exc), level=getattr(exc, "level", None),
                      ranks=list(getattr(exc, "ranks", ()) or ()), errno=getattr(exc, "errno", None))  # fmt: skip
        raise
    finally:
        with open(os.path.join(out, f"{phase}-rank{RANK}.json"), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    run_then_exit(main)  # no interpreter finalization: a gloo thread may abort it
