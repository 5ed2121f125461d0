"""The supported version range: older Lightning's stock loader.

Lightning 2.5's ``TorchCheckpointIO.load_checkpoint(path, map_location)`` has no ``weights_only``; the
plugin must call it without one (resume and ``Fabric.load`` broke with a TypeError). The `frameworks` nox
session runs the integration tests against the real oldest release; these tests pin the behaviour on any
installed version by giving the plugin a stock loader with the old signature.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from lazyckpt import LazyCheckpointer  # noqa: E402
from lazyckpt.lightning import LazyCheckpointIO  # noqa: E402
from lazyckpt.lightning import _compat as _lightning_compat  # noqa: E402
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
