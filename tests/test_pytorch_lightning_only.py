"""An install with only the standalone ``pytorch_lightning`` (it ships ``lightning_fabric``), no ``lightning``.

Runs in a child with ``lightning`` made unimportable, so it checks the same thing in a full install (both
packages) and in the `frameworks-pl_only` nox session (only ``pytorch_lightning`` installed).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

# The child's first lines: lightning unimportable, and a tiny LightningModule of pytorch_lightning's.
_PRELUDE = """
import sys
sys.modules["lightning"] = None  # as if only pytorch_lightning were installed
import pytorch_lightning as pl
import torch

class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(8, 1)
    def training_step(self, batch, _):
        return self.layer(batch[0]).pow(2).mean()
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=0.1)
    def train_dataloader(self):
        data = torch.utils.data.TensorDataset(torch.randn(32, 8))
        return torch.utils.data.DataLoader(data, batch_size=4)
"""


def _run_pl_only(body: str, timeout: float) -> None:
    """Run ``body`` after the prelude in a child; it must print ``ok`` last."""
    pytest.importorskip("pytorch_lightning")
    script = _PRELUDE + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_pytorch_lightning_only_install_saves_and_resumes(tmp_path: Any) -> None:
    """``lightning`` unimportable: the plugin builds on ``lightning_fabric`` and serves ``pytorch_lightning``."""
    _run_pl_only(
        f"""
        from pytorch_lightning.callbacks import ModelCheckpoint
        from lazyckpt.lightning import LazyCheckpointIO
        import lazyckpt.lightning._compat as compat
        assert compat.checkpoint_io_base().__module__.startswith("lightning_fabric."), compat.checkpoint_io_base()

        kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                  enable_model_summary=False, default_root_dir={str(tmp_path)!r})
        ckpt = ModelCheckpoint(dirpath={str(tmp_path)!r}, filename="last", every_n_train_steps=4)
        trainer = pl.Trainer(max_epochs=1, plugins=[LazyCheckpointIO()], callbacks=[ckpt], **kw)
        trainer.fit(Model())
        resumed = pl.Trainer(max_epochs=2, plugins=[LazyCheckpointIO()], **kw)
        resumed.fit(Model(), ckpt_path={str(tmp_path / "last.ckpt")!r})
        assert resumed.global_step == 16, resumed.global_step
        assert "lightning" not in {{name.split(".")[0] for name, m in sys.modules.items() if m is not None}}
        print("ok")
        """,
        timeout=110,
    )


def test_pytorch_lightning_only_multi_level_checkpoint(tmp_path: Any) -> None:
    """``lightning`` unimportable: the callback builds on ``pytorch_lightning``'s Callback and serves its Trainer."""
    _run_pl_only(
        f"""
        import lazyckpt
        from lazyckpt import Level
        from lazyckpt.lightning import LazyCheckpointIO, MultiLevelCheckpoint
        assert MultiLevelCheckpoint.__mro__[1].__module__.startswith("pytorch_lightning.")

        levels = [Level({str(tmp_path / "a")!r}, every=1, keep=2), Level({str(tmp_path / "b")!r}, every=3, keep=1)]
        kw = dict(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False, enable_model_summary=False,
                  enable_checkpointing=False)
        first = pl.Trainer(max_steps=7, plugins=[LazyCheckpointIO()], callbacks=[MultiLevelCheckpoint(levels)], **kw)
        first.fit(Model())
        found = lazyckpt.latest(levels)
        assert (found.step, found.level) == (7, 0), found
        trainer = pl.Trainer(max_steps=9, plugins=[LazyCheckpointIO()], callbacks=[MultiLevelCheckpoint(levels)], **kw)
        trainer.fit(Model(), ckpt_path=found.path)
        assert trainer.global_step == 9 and lazyckpt.latest(levels).step == 9
        print("ok")
        """,
        timeout=170,
    )
