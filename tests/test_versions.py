"""The supported version range: older Lightning's stock loader, and an install with only ``pytorch_lightning``.

Lightning 2.5's ``TorchCheckpointIO.load_checkpoint(path, map_location)`` has no ``weights_only``; the
plugin must call it without one (resume and ``Fabric.load`` broke with a TypeError). The `frameworks` nox
session runs the integration tests against the real oldest release; these tests pin the behaviour on any
installed version by giving the plugin a stock loader with the old signature.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lazyckpt import LazyCheckpointer, _lightning_compat  # noqa: E402
from lazyckpt.lightning import LazyCheckpointIO  # noqa: E402
from lightning_scripts.tiny_gpt import TinyGPT, trainer_kwargs  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


class Lightning25TorchCheckpointIO(TorchCheckpointIO):
    """The stock loader as Lightning 2.5.6 has it: no ``weights_only`` parameter."""

    calls: list[dict[str, Any]] = []

    def load_checkpoint(self, path: Any, map_location: Any = lambda storage, loc: storage) -> dict[str, Any]:
        Lightning25TorchCheckpointIO.calls.append({"path": path, "map_location": map_location})
        return torch.load(path, map_location=map_location, weights_only=False)


@pytest.fixture
def old_stock_loader(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    Lightning25TorchCheckpointIO.calls = []
    monkeypatch.setattr(_lightning_compat, "stock_torch_io", lambda base: Lightning25TorchCheckpointIO())
    return Lightning25TorchCheckpointIO.calls


def test_stock_load_passes_weights_only_only_where_the_signature_has_it(tmp_path: Any) -> None:
    path = tmp_path / "x.pt"
    torch.save({"w": torch.ones(2)}, path)
    seen: dict[str, Any] = {}

    class New:
        def load_checkpoint(self, path: Any, map_location: Any = None, weights_only: bool | None = None) -> Any:
            seen.update(map_location=map_location, weights_only=weights_only)
            return {}

    _lightning_compat.stock_load(New(), path, "cpu", True)
    assert seen == {"map_location": "cpu", "weights_only": True}
    got = _lightning_compat.stock_load(Lightning25TorchCheckpointIO(), path, None, True)
    assert torch.equal(got["w"], torch.ones(2))


def test_trainer_resumes_with_a_stock_loader_without_weights_only(
    tmp_path: Any, old_stock_loader: list[dict[str, Any]]
) -> None:
    L.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=tmp_path, filename="last", save_top_k=-1, every_n_train_steps=4)
    first_io = LazyCheckpointIO()
    trainer = L.Trainer(default_root_dir=tmp_path, plugins=[first_io], callbacks=[ckpt], **trainer_kwargs())
    trainer.fit(TinyGPT())
    # Threads left by a Trainer that only loads, and by a torn-down plugin whose checkpointer the next fit
    # re-opens, are other defects (issue 20 #6): this test closes both itself.
    with LazyCheckpointer() as checkpointer:
        io = LazyCheckpointIO(checkpointer=checkpointer)
        resumed = L.Trainer(
            default_root_dir=tmp_path, plugins=[io], enable_checkpointing=False, **trainer_kwargs(max_epochs=3)
        )
        resumed.fit(TinyGPT(), ckpt_path=str(tmp_path / "last.ckpt"))
    assert [str(c["path"]) for c in old_stock_loader] == [str(tmp_path / "last.ckpt")]
    assert resumed.global_step > trainer.global_step
    first_io.teardown()


def test_fabric_load_with_a_stock_loader_without_weights_only(
    tmp_path: Any, old_stock_loader: list[dict[str, Any]]
) -> None:
    io = LazyCheckpointIO()
    fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[io])
    model = fabric.setup(torch.nn.Linear(4, 4))
    fabric.save(tmp_path / "f.ckpt", {"model": model, "step": 3})
    state = {"model": model}
    rest = fabric.load(tmp_path / "f.ckpt", state)
    assert rest == {"step": 3}
    assert len(old_stock_loader) == 1
    io.teardown()  # Fabric never calls it


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
        import lazyckpt._lightning_compat as compat
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
