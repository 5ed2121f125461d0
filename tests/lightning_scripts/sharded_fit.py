"""Run by tests/test_lightning_sharded.py, once per rank (the test starts both processes with
LOCAL_RANK/WORLD_SIZE set, so every Trainer of this script joins the same 2 gloo processes):
``python sharded_fit.py OUT_DIR CASE``, with tests/ and the repository root on PYTHONPATH.

A small GPT, FSDP2 ``fully_shard`` in ``configure_model``, ``ModelParallelStrategy`` on CPU. Cases:

- ``fit``: a stock fit and a lazy fit (``plugins=[LazyCheckpointIO()]``), same seeds, checkpoint
  every step with top-k and ``save_last``; the lazy fit dumps the full state at each save (a
  callback, inside ``dump_checkpoint``). Then a stock resume from the lazy step-3 folder and one
  with ``ckpt_path="last"``, each to the end, and their final states.
- ``crash``: a 2-step lazy fit in which rank 0 deletes the step-1 folder while its save is pending;
  then a lazy fit in which rank 1 dies right after handing over the step-3 saves.

- ``fault``: a lazy fit in which every write of rank 1 fails with ENOSPC.
- ``s3``: a 4-step lazy fit with ``ModelCheckpoint(dirpath=$LAZYCKPT_TEST_S3_DIR)`` (an ``s3://``
  prefix on the test's moto server, credentials and endpoint from the ``AWS_*`` environment),
  top-2 and ``save_last``; the full state dumped at each save, as in ``fit``.

Rank 0 writes what the test compares under OUT_DIR; every rank writes ``rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from _util import run_then_exit
from benchmarks import gpt
from lazyckpt.lightning import LazyCheckpointIO

STEPS = 6


class ShardedGPT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.cfg = gpt.GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32)
        self.gpt: nn.Module | None = None

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        if self.gpt is not None:
            return
        torch.manual_seed(0)
        self.gpt = gpt.GPT(self.cfg)
        for block in self.gpt.h:
            fully_shard(block, mesh=self.device_mesh["data_parallel"])
        fully_shard(self.gpt, mesh=self.device_mesh["data_parallel"])

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        (idx,) = batch
        assert self.gpt is not None
        logits = self.gpt(idx[:, :-1])[0]
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), idx[:, 1:].reshape(-1))

    def configure_optimizers(self) -> Any:
        opt = torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        g = torch.Generator().manual_seed(0)
        data = torch.randint(0, 64, (24, 17), generator=g)  # 3 batches per rank: an epoch is 3 steps
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)


class DumpAtSave(Callback):
    """The full state at each save (a collective on every rank), kept by rank 0 per global step."""

    def __init__(self) -> None:
        self.dumps: dict[int, dict[str, Any]] = {}

    def on_save_checkpoint(self, trainer: Any, pl_module: Any, checkpoint: dict[str, Any]) -> None:
        full = {"state_dict": _full(checkpoint["state_dict"])}
        for i, osd in enumerate(checkpoint["optimizer_states"]):
            full[f"optimizer_{i}"] = _full(osd)
        if trainer.is_global_zero:
            self.dumps[trainer.global_step] = full


class DieAfterSave(Callback):
    """Rank 1 exits hard (no atexit drain) once the step-3 saves were handed over, before any later
    step or call into lazyckpt: its part of the last save (last.ckpt) is never confirmed."""

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == 3 and trainer.global_rank == 1:
            os._exit(3)


def _full(obj: Any) -> Any:
    from torch.distributed.tensor import DTensor

    if isinstance(obj, DTensor):
        return obj.full_tensor().detach().clone()
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: _full(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_full(v) for v in obj]
    return obj


def trainer(out: str, name: str, plugins: list[Any], callbacks: list[Any], steps: int = STEPS) -> L.Trainer:
    # Top-2 by step (so every save deletes an older folder) and a copied last.ckpt; every third step
    # kept in a folder of its own (what the resume starts from).
    topk = ModelCheckpoint(dirpath=os.path.join(out, name), every_n_train_steps=1, save_top_k=2, monitor="step",
                           mode="max", save_last=True)  # fmt: skip
    every3 = ModelCheckpoint(dirpath=os.path.join(out, name + "-every3"), every_n_train_steps=3, save_top_k=-1)
    return L.Trainer(
        accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=steps, plugins=plugins,
        callbacks=[topk, every3, *callbacks], logger=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0,
    )  # fmt: skip


def final_state(t: L.Trainer, module: ShardedGPT) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    assert module.gpt is not None
    msd, osd = get_state_dict(module.gpt, t.optimizers[0], options=StateDictOptions(full_state_dict=True))
    return {"model": msd, "optim": osd, "step": t.global_step}


def case_fit(out: str) -> dict[str, Any]:
    report: dict[str, Any] = {}
    for name in ("stock", "lazy"):
        plugins = [LazyCheckpointIO()] if name == "lazy" else []
        L.seed_everything(0, verbose=False)
        dump = DumpAtSave()
        t = trainer(out, name, plugins, [dump] if plugins else [])
        module = ShardedGPT()
        t.fit(module)
        end = final_state(t, module)
        if t.is_global_zero:
            torch.save(end, os.path.join(out, f"{name}-end.pt"))
            if plugins:
                torch.save(dump.dumps, os.path.join(out, "dumps.pt"))
    if int(os.environ["LOCAL_RANK"]) == 0:  # the resumes below write into lazy/ and stock/ again
        for name in ("lazy", "stock", "lazy-every3", "stock-every3"):
            shutil.copytree(os.path.join(out, name), os.path.join(out, "snap", name), symlinks=True)
    torch.distributed.barrier()
    # Stock Lightning (no plugin) resumes from lazy folders: step 3 to the end (same as the
    # uninterrupted runs), and "last" (step 6) two steps further, as stock does from its own last.
    resumes = (
        ("resume3", os.path.join(out, "lazy-every3", "epoch=0-step=3.ckpt"), STEPS, "resume3"),
        ("resume3stock", os.path.join(out, "stock-every3", "epoch=0-step=3.ckpt"), STEPS, "resume3stock"),
        ("lastlazy", "last", STEPS + 2, "lazy"),
        ("laststock", "last", STEPS + 2, "stock"),
    )
    for name, ckpt_path, steps, dirname in resumes:
        L.seed_everything(0, verbose=False)
        t = trainer(out, dirname, [], [], steps=steps)
        module = ShardedGPT()
        t.fit(module, ckpt_path=ckpt_path)
        end = final_state(t, module)
        if t.is_global_zero:
            torch.save(end, os.path.join(out, f"{name}-end.pt"))
    return report


class RemoveWhilePending(Callback):
    """At the start of step 2, rank 0 deletes the step-1 folder while its save is certainly pending
    (no rank has called into lazyckpt or stepped since, so it cannot have committed), through the
    strategy as ModelCheckpoint does."""

    def __init__(self, io: LazyCheckpointIO, folder: str) -> None:
        self.io, self.folder, self.was_pending = io, folder, False

    def on_train_batch_start(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step == 1 and trainer.is_global_zero:
            self.was_pending = self.folder in self.io.pending_paths() and not os.path.exists(self.folder)
            trainer.strategy.remove_checkpoint(self.folder)


def case_crash(out: str) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    io = LazyCheckpointIO()
    remover = RemoveWhilePending(io, os.path.join(out, "remove", "step1.ckpt"))
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "remove"), filename="step{step}", auto_insert_metric_name=False,
                           every_n_train_steps=1, save_top_k=-1)  # fmt: skip
    t = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=2, plugins=[io],
                  callbacks=[ckpt, remover], logger=False, enable_progress_bar=False,
                  enable_model_summary=False)  # fmt: skip
    t.fit(ShardedGPT())
    if t.is_global_zero:
        with open(os.path.join(out, "remove.json"), "w") as f:
            json.dump({"was_pending": remover.was_pending}, f)
    L.seed_everything(0, verbose=False)
    t = trainer(out, "crash", [LazyCheckpointIO()], [DieAfterSave()])
    t.fit(ShardedGPT())
    return {}


def case_fault(out: str) -> dict[str, Any]:
    """Rank 1's writes fail (ENOSPC, injected at lazyckpt's one write call): fit() must raise on
    every rank once teardown has drained them."""
    import errno

    from lazyckpt.distributed import DistributedSaveError
    from lazyckpt.storage import fs as _fs

    if int(os.environ["LOCAL_RANK"]) == 1:

        def no_space(fd: int, data: Any, offset: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")

        _fs.pwrite_all = no_space  # type: ignore[assignment]
    ckpt = ModelCheckpoint(dirpath=os.path.join(out, "fault"), every_n_train_steps=1, save_top_k=-1)
    t = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=2,
                  plugins=[LazyCheckpointIO()], callbacks=[ckpt], logger=False, enable_progress_bar=False,
                  enable_model_summary=False)  # fmt: skip
    try:
        t.fit(ShardedGPT())
    except DistributedSaveError as exc:
        return {"raised": type(exc).__name__, "ranks": list(exc.ranks), "message": str(exc)}
    return {"raised": None}


def case_s3(out: str) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    dump = DumpAtSave()
    topk = ModelCheckpoint(dirpath=os.environ["LAZYCKPT_TEST_S3_DIR"], every_n_train_steps=1, save_top_k=2,
                           monitor="step", mode="max", save_last=True)  # fmt: skip
    t = L.Trainer(accelerator="cpu", devices=2, strategy=ModelParallelStrategy(), max_steps=4,
                  plugins=[LazyCheckpointIO(local_dir=os.path.join(out, f"tier-{os.environ['LOCAL_RANK']}"))],
                  callbacks=[topk, dump], logger=False, enable_progress_bar=False,
                  enable_model_summary=False)  # fmt: skip
    t.fit(ShardedGPT())
    if t.is_global_zero:
        torch.save(dump.dumps, os.path.join(out, "dumps.pt"))
    return {"best_k": sorted(os.path.basename(k) for k in topk.best_k_models)}


def main() -> None:
    out, case = sys.argv[1], sys.argv[2]
    report = {"fit": case_fit, "crash": case_crash, "fault": case_fault, "s3": case_s3}[case](out)
    report["rank"] = int(os.environ["LOCAL_RANK"])
    with open(os.path.join(out, f"rank{report['rank']}.json"), "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    run_then_exit(main)  # no interpreter finalization: a gloo thread may abort it
