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

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def test_pytorch_lightning_only_install_saves_and_resumes(tmp_path: Any) -> None:
    """``lightning`` unimportable: the plugin builds on ``lightning_fabric`` and serves ``pytorch_lightning``."""
    pytest.importorskip("pytorch_lightning")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["lightning"] = None  # as if only pytorch_lightning were installed
        import pytorch_lightning as pl
        import torch
        from pytorch_lightning.callbacks import ModelCheckpoint
        from lazyckpt.lightning import LazyCheckpointIO
        import lazyckpt.lightning._compat as compat
        assert compat.checkpoint_io_base().__module__.startswith("lightning_fabric."), compat.checkpoint_io_base()

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
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=110)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")
