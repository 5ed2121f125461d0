"""What the documentation's code examples take as given ("`model`, `optimizer` and `loader` are yours"):
tiny stand-ins, built only for the names a page's code uses. ``tests/test_docs.py`` runs each page's
examples, in order, in one fresh process whose globals start from :func:`names`."""

from __future__ import annotations

import os
import re
import socket
from typing import Any

import torch


def _uses(code: str, name: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(name)}\b", code) is not None


def names(code: str) -> dict[str, Any]:
    """The stand-ins ``code`` (a page's examples, joined) reads without defining them."""
    torch.manual_seed(0)
    env: dict[str, Any] = {"torch": torch}
    model = torch.nn.Linear(8, 8)
    env["model"] = model
    env["optimizer"] = torch.optim.AdamW(model.parameters())
    env["loader"] = [(torch.randn(4, 8), torch.randn(4, 8)) for _ in range(4)]
    env["state"] = {"model": model.state_dict(), "optim": env["optimizer"].state_dict()}
    if _uses(code, "LitModel"):
        from lightning.pytorch.demos.boring_classes import BoringModel

        env["LitModel"] = BoringModel
    if _uses(code, "ShardedLitModel"):
        env["ShardedLitModel"] = _sharded_lit_model()
    if _uses(code, "hf_model") or _uses(code, "train_dataset"):
        from tests.transformers_scripts import tiny

        env["hf_model"] = tiny.model()
        env["train_dataset"] = tiny.Tokens()
    if _uses(code, "deepspeed"):  # a DeepSpeed engine on CPU, in a world of 1 (set up below)
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
        import deepspeed

        env["deepspeed"] = deepspeed
        env["cfg"] = {
            "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10**9, "zero_optimization": {"stage": 2},
            "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        }  # fmt: skip
    if any(
        _uses(code, n) for n in ("DistributedCheckpointer", "init_process_group", "ModelParallelStrategy", "deepspeed")
    ):
        import torch.distributed as dist

        with socket.socket() as s:  # one process: a world of 1 over gloo, as torchrun would set it up
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        if not _uses(code, "ModelParallelStrategy") and "init_process_group(" not in code:
            dist.init_process_group("gloo")
    return env


def _sharded_lit_model() -> type:
    """A LightningModule that shards itself with FSDP2 in ``configure_model`` (ModelParallelStrategy)."""
    import lightning as L
    from lightning.pytorch.demos.boring_classes import RandomDataset

    class ShardedLitModel(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net: torch.nn.Module | None = None

        def configure_model(self) -> None:
            from torch.distributed.fsdp import fully_shard

            if self.net is None:
                self.net = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))
                fully_shard(self.net, mesh=self.device_mesh["data_parallel"])

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            assert self.net is not None
            return self.net(batch).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters())

        def train_dataloader(self) -> torch.utils.data.DataLoader:
            return torch.utils.data.DataLoader(RandomDataset(32, 64), batch_size=2)

    return ShardedLitModel
