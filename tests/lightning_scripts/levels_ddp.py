"""Run by tests/test_lightning_levels.py: ``python levels_ddp.py OUT {resume,enospc}`` with tests/ and the
repository root on PYTHONPATH. Lightning's subprocess launcher re-runs this script for rank 1.

``resume``: three fits with strategy="ddp" on 2 gloo processes, one launch: an uninterrupted reference
(one level keeping every step), a fit stopped at step 5 with a memory and a disk level and a
ModelCheckpoint alongside, and a stock resume from ``latest()`` to step 10 with the same callbacks.
Each rank writes OUT/rank<r>.json: what its plugin did and its final state's digest.
``enospc``: the disk level's writes fail with ENOSPC (every rank patches it; only rank 0 writes):
each rank records the exception ``fit`` raised in OUT/rank<r>.json.
"""

from __future__ import annotations

import errno
import json
import os
import sys
from typing import Any

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import lazyckpt
from _util import run_then_exit
from lazyckpt import Level
from lazyckpt.lightning import LazyCheckpointIO, MultiLevelCheckpoint
from lazyckpt.storage import fs as _fs
from lightning_scripts.levels_gpt import StepGPT, digest, level_trainer, state_of


def fit(out: str, levels: list[Level], steps: int, ckpt_path: str | None = None, mc: bool = False) -> Any:
    torch.manual_seed(0)
    io = LazyCheckpointIO()
    callbacks: list[Any] = [MultiLevelCheckpoint(levels)]
    if mc:
        callbacks.append(ModelCheckpoint(dirpath=os.path.join(out, "mc"), every_n_train_steps=2, save_top_k=2,
                                         monitor="step", mode="max", save_last=True))  # fmt: skip
    trainer = level_trainer(callbacks, [io], max_steps=steps, devices=2, strategy="ddp", deterministic=False,
                            enable_checkpointing=mc)  # fmt: skip
    trainer.fit(StepGPT(batches=8), ckpt_path=ckpt_path)
    return trainer, io


def resume(out: str) -> None:
    ref = [Level(os.path.join(out, "reference"), every=1)]
    levels = [Level(os.path.join(out, "mem"), every=1, keep=2), Level(os.path.join(out, "disk"), every=3, keep=2)]
    whole, _ = fit(out, ref, 10)
    _, first = fit(out, levels, 5, mc=True)
    found = lazyckpt.latest(levels)  # every rank reads the same files (rank 0 wrote them)
    trainer, io = fit(out, levels, 10, ckpt_path=found.path if found else None, mc=True)
    report = {
        "rank": trainer.global_rank,
        "found": None if found is None else [found.step, found.level],
        "global_step": trainer.global_step,
        "same_as_uninterrupted": digest(state_of(trainer)) == digest(state_of(whole)),
        "saves": len(first.stats) + len(io.stats),
        "files_same": [  # the levels' files against the uninterrupted run's (rank 0 wrote both)
            digest(torch.load(level.file(step), weights_only=False))
            == digest(torch.load(ref[0].file(step), weights_only=False))
            for level, step in ((levels[0], 9), (levels[0], 10), (levels[1], 9))
        ],
    }
    with open(os.path.join(out, f"rank{trainer.global_rank}.json"), "w") as f:
        json.dump(report, f)


def enospc(out: str) -> None:
    disk = os.path.join(out, "disk")
    real = _fs.open_temporary

    def full(tmp: str, size: int) -> int:
        if tmp.startswith(disk):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tmp, size)

    _fs.open_temporary = full  # type: ignore[assignment]
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    result: dict[str, Any] = {"rank": rank, "raised": None}
    try:
        fit(out, [Level(os.path.join(out, "mem"), every=1, keep=2), Level(disk, every=2)], 40)
    except BaseException as exc:
        result["raised"] = type(exc).__name__
        result["level"] = getattr(exc, "level", None)
        result["message"] = str(exc)
        raise
    finally:
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    # no interpreter finalization: a gloo thread may abort it
    run_then_exit(lambda: {"resume": resume, "enospc": enospc}[sys.argv[2]](sys.argv[1]))
