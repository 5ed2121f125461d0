"""Run by tests/test_lightning_ddp.py: ``python ddp_fit.py OUT_DIR {ddp,fsdp}``, with tests/ and the
repository root on PYTHONPATH.

Lightning's subprocess launcher re-runs this script for rank 1. Rank 0 keeps a deep copy of every
checkpoint it was handed (only rank 0 reaches CheckpointIO) and writes it with plain torch.save next
to the lazy files; every rank writes a small report of what its plugin did.
"""

from __future__ import annotations

import json
import os
import sys

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from _util import run_then_exit
from lightning_scripts.tiny_gpt import RecordingLazyIO, TinyGPT, trainer_kwargs


def main() -> None:
    out, mode = sys.argv[1], sys.argv[2]
    io = RecordingLazyIO()
    if mode == "fsdp":
        from lightning.pytorch.strategies import FSDPStrategy

        strategy = FSDPStrategy(state_dict_type="full")
    else:
        strategy = "ddp"
    L.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "ck"), every_n_train_steps=1, save_top_k=2, monitor="step",
                           mode="max", save_last=True)  # fmt: skip
    kwargs = trainer_kwargs(devices=2, strategy=strategy, max_epochs=2, deterministic=False)
    if mode == "fsdp":
        kwargs["accelerator"] = "gpu"
    trainer = L.Trainer(plugins=[io], callbacks=[ckpt], **kwargs)
    trainer.fit(TinyGPT(batches=4))
    rank = trainer.global_rank
    if rank == 0:
        os.makedirs(os.path.join(out, "expected"), exist_ok=True)
        for path, dumps in io.expected.items():
            torch.save(dumps[-1], os.path.join(out, "expected", os.path.basename(path)))
    report = {
        "rank": rank,
        "saves": sum(len(d) for d in io.expected.values()),
        "stats": len(io.stats),
        "created_checkpointer": bool(io.stats) or io.expected != {},
        "global_step": trainer.global_step,
    }
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    run_then_exit(main)  # no interpreter finalization: a gloo thread may abort it
