"""LazyCheckpointIO driven through real Lightning Trainers and Fabric on CPU, with a tiny GPT.

Every test compares against something independent of lazyckpt: a deep copy of what dump_checkpoint
handed to the plugin, a run with the stock TorchCheckpointIO, or a Trainer without lazyckpt.
"""

from __future__ import annotations

import csv
import glob
import os
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

try:  # Lightning >= 2.6
    from lightning.pytorch.callbacks import EMAWeightAveraging
except ImportError:  # pragma: no cover - older Lightning
    EMAWeightAveraging = None
from lightning.pytorch.loggers import CSVLogger, Logger  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from lazyckpt import CheckpointerOptions, LazyCheckpointer, SaveHandle  # noqa: E402
from lazyckpt.core.handle import Completion  # noqa: E402
from lazyckpt.errors import LazyCkptError, SaveRefusedError, WriteError  # noqa: E402
from lazyckpt.lightning import LazyCheckpointIO  # noqa: E402
from lightning_scripts.tiny_gpt import (  # noqa: E402
    DeferredCommitCheckpointer,
    RecordingLazyIO,
    TinyGPT,
    assert_files_match_expected,
    assert_same,
    fabric_with_tiny_gpt,
    load,
    trainer_kwargs,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


def fit(tmp_path: Any, io: Any, callbacks: list[Any], model: TinyGPT | None = None, **kw: Any) -> L.Trainer:
    L.seed_everything(0, verbose=False)
    model = model or TinyGPT()
    plugins = [io] if io is not None else []
    plugins += kw.pop("plugins", [])
    ckpt_path = kw.pop("ckpt_path", None)
    trainer = L.Trainer(default_root_dir=tmp_path, plugins=plugins, callbacks=callbacks, **trainer_kwargs(**kw))
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def every_step(dirpath: Any, **kw: Any) -> ModelCheckpoint:
    kw.setdefault("filename", "{epoch}-{step}")
    return ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=-1, **kw)


def no_temporaries(directory: Any) -> None:
    names = os.listdir(directory)
    assert all(n.endswith(".ckpt") or n.endswith(".csv") or n.endswith(".yaml") for n in names), names


# -- the checkpoint is what dump_checkpoint produced -------------------------------------------------


@pytest.mark.parametrize(
    "precision, extra",
    [
        ("32-true", {}),
        ("bf16-mixed", {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}),
        ("16-mixed", {"gradient_clip_val": 1.0}),
    ],
)
def test_every_checkpoint_equals_dump(tmp_path: Any, precision: str, extra: dict[str, Any]) -> None:
    io = RecordingLazyIO()
    plugins: list[Any] = []
    if precision == "16-mixed":
        # A huge initial scale overflows the first steps: the scaler skips them (no optimizer.step).
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**40, growth_interval=1)
        plugins = [MixedPrecision("16-mixed", "cpu", scaler=scaler)]
    trainer = fit(tmp_path, io, [every_step(tmp_path / "ck", save_last=True)], plugins=plugins,
                  precision=None if plugins else precision, **extra)  # fmt: skip
    saved = [p for p in io.expected if not p.endswith("last.ckpt")]
    assert len(saved) == trainer.global_step >= 8
    assert assert_files_match_expected(io) == len(saved) + 1
    if precision == "16-mixed":
        scale = [load(p)["MixedPrecision"]["scale"] for p in sorted(saved, key=os.path.getmtime)]
        assert scale[0] < 2.0**40, "the scaler never skipped a step: the test does not cover skipped steps"
    no_temporaries(tmp_path / "ck")


def test_resume_with_stock_trainer_and_load_from_checkpoint(tmp_path: Any) -> None:
    io = RecordingLazyIO()
    fit(tmp_path / "a", io, [every_step(tmp_path / "lazy", save_last=True)], max_epochs=1)
    fit(tmp_path / "b", None, [every_step(tmp_path / "stock", save_last=True)], max_epochs=1)
    lazy_last, stock_last = str(tmp_path / "lazy" / "last.ckpt"), str(tmp_path / "stock" / "last.ckpt")
    assert_same(io.expected[lazy_last][-1], load(lazy_last))

    # A Trainer without lazyckpt resumes from the lazy file exactly as from the stock file.
    from_lazy, from_stock = TinyGPT(), TinyGPT()
    fit(tmp_path / "c", None, [], model=from_lazy, max_epochs=2, ckpt_path=lazy_last)
    fit(tmp_path / "d", None, [], model=from_stock, max_epochs=2, ckpt_path=stock_last)
    assert_same(from_stock.state_dict(), from_lazy.state_dict(), "resumed from lazy vs from stock")

    restored = TinyGPT.load_from_checkpoint(lazy_last)
    assert_same(io.expected[lazy_last][-1]["state_dict"], restored.state_dict(), "load_from_checkpoint")


# -- ModelCheckpoint behaves as with the stock plugin -----------------------------------------------

CONFIGS = {
    "topk_monitor_last": dict(monitor="train_loss", save_top_k=2, every_n_train_steps=1, save_last=True),
    "topk1_link": dict(monitor="step", mode="max", save_top_k=1, every_n_train_steps=2, save_last="link"),
    "version_suffixes": dict(filename="{epoch}", monitor="step", mode="max", save_top_k=3, every_n_train_steps=2),
    "every_n_epochs": dict(save_top_k=-1, every_n_epochs=1, filename="{epoch}-{step}"),
    "train_time_interval": dict(filename="{step}", save_top_k=-1, train_time_interval=timedelta(0)),
}


def _listing(directory: Any) -> dict[str, str | None]:
    return {
        n: (os.readlink(os.path.join(directory, n)) if os.path.islink(os.path.join(directory, n)) else None)
        for n in sorted(os.listdir(directory))
    }


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_model_checkpoint_file_set_matches_stock(tmp_path: Any, name: str) -> None:
    config = CONFIGS[name]
    stock = fit(tmp_path / "s", None, [ModelCheckpoint(dirpath=tmp_path / "stock", **config)], max_epochs=3)
    # Every file is still pending when ModelCheckpoint takes its next decision (names, deletes, links).
    slow = DeferredCommitCheckpointer()
    io = RecordingLazyIO(checkpointer=slow)
    lazy = fit(tmp_path / "l", io, [ModelCheckpoint(dirpath=tmp_path / "lazy", **config)], max_epochs=3)
    slow.close()
    assert _listing(tmp_path / "lazy") == _listing(tmp_path / "stock")
    assert len(_listing(tmp_path / "lazy")) >= 2
    for n in _listing(tmp_path / "lazy"):  # training is deterministic: same contents too
        a, b = load(str(tmp_path / "stock" / n)), load(str(tmp_path / "lazy" / n))
        assert_same(a["state_dict"], b["state_dict"], n)
        assert a["callbacks"].keys() == b["callbacks"].keys()
    assert (
        stock.checkpoint_callback.best_model_path.replace("stock", "lazy") == lazy.checkpoint_callback.best_model_path
    )
    assert_files_match_expected(io)


def test_ckpt_path_last_resumes_from_lazy_last(tmp_path: Any) -> None:
    io = RecordingLazyIO()

    def cb() -> ModelCheckpoint:
        return ModelCheckpoint(
            dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=1, monitor="step", mode="max", save_last=True
        )

    first = fit(tmp_path, io, [cb()], max_epochs=1)
    second = fit(tmp_path, RecordingLazyIO(), [cb()], max_epochs=2, ckpt_path="last")
    assert second.global_step == 2 * first.global_step
    assert_same(io.expected[str(tmp_path / "ck" / "last.ckpt")][-1]["global_step"], first.global_step)


# -- pending writes vs deletes and loads (plugin level) ----------------------------------------------


def _big_state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((4 << 20,), value)}  # 16 MB: the write is still pending when we act


@pytest.mark.parametrize("slow", [True, False], ids=["held", "real"])
def test_remove_of_pending_save_never_resurrects(tmp_path: Any, slow: bool) -> None:
    ckpt = DeferredCommitCheckpointer() if slow else None
    io = LazyCheckpointIO(checkpointer=ckpt)
    a, b = str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")
    io.save_checkpoint(_big_state(1.0), a)
    assert not slow or io.pending_paths() == {a}
    io.remove_checkpoint(a)  # must not wait; the file must end up gone (after a's commit: checked below)
    io.save_checkpoint(_big_state(2.0), b)
    io.remove_checkpoint(b)
    io.save_checkpoint(_big_state(3.0), b)  # a save after the remove must survive the deferred delete
    io.wait()
    assert not os.path.exists(a)
    assert load(b)["w"][0].item() == 3.0
    assert io.pending_paths() == set()
    io.teardown()
    if ckpt is not None:
        ckpt.close()
    assert sorted(os.listdir(tmp_path)) == ["b.ckpt"]


def test_load_waits_for_pending_save(tmp_path: Any) -> None:
    ckpt = DeferredCommitCheckpointer()
    io = LazyCheckpointIO(checkpointer=ckpt)
    path = str(tmp_path / "x.ckpt")
    state = _big_state(5.0)
    io.save_checkpoint(state, path)
    assert not os.path.exists(path)
    state["w"].fill_(0)  # not optimizer-owned: captured inside save_checkpoint, so this is allowed
    assert load_through(io, path)["w"][0].item() == 5.0
    io.teardown()
    ckpt.close()


def load_through(io: LazyCheckpointIO, path: str) -> dict[str, Any]:
    return io.load_checkpoint(path)


# -- errors ----------------------------------------------------------------------------------------


class FailingCheckpointer(LazyCheckpointer):
    """Fault injection: every save fails in the background (after a real write elsewhere)."""

    def save(self, obj: Any, path: Any, format: str = "torch", metadata: Any = None) -> SaveHandle:
        real = super().save(obj, os.fspath(path) + ".real", format)
        fake = Completion(os.path.abspath(os.fspath(path)))

        def fail(_h: SaveHandle) -> None:
            err = WriteError("injected disk failure", path=fake.handle.path)
            self.add_error(err)  # as the core publishes a failed save's error, before its handle is done
            fake.finish(None, err)

        real.add_done_callback(fail)
        return fake.handle


def test_background_error_reaches_fit(tmp_path: Any) -> None:
    ckpt = FailingCheckpointer()
    with pytest.raises(WriteError, match="injected"):
        fit(tmp_path, LazyCheckpointIO(checkpointer=ckpt), [every_step(tmp_path / "ck")], max_epochs=1)
    try:  # a later save already under way when fit raised fails too: its error is raised here, once
        ckpt.close()
    except WriteError as exc:
        assert "injected" in str(exc)
    assert not glob.glob(str(tmp_path / "ck" / "*.ckpt"))


class Boom(RuntimeError):
    pass


def test_exception_during_fit_keeps_staged_save(tmp_path: Any) -> None:
    class Exploding(TinyGPT):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            if self.global_step == 5:
                raise Boom("training failed")
            return super().training_step(batch, batch_idx)

    io = RecordingLazyIO()
    with pytest.raises(Boom):  # the training error propagates, not a checkpoint error
        fit(tmp_path, io, [every_step(tmp_path / "ck")], model=Exploding(), max_epochs=1)
    assert assert_files_match_expected(io) == 5
    assert io.pending_paths() == set()


# -- in-place state swaps ----------------------------------------------------------------------------


@pytest.mark.skipif(EMAWeightAveraging is None, reason="EMAWeightAveraging needs Lightning >= 2.6")
def test_ema_weight_averaging_checkpoints_are_exact(tmp_path: Any) -> None:
    # Saves on the last batch of each epoch are followed at once by validation, where the callback
    # swaps averaged weights into the live parameters through `.data` (invisible to `_version`).
    io = RecordingLazyIO()
    model = TinyGPT(dim=256, layers=2, val_batches=2)  # big enough that staging is still running
    fit(tmp_path, io, [EMAWeightAveraging(), every_step(tmp_path / "ck")], model=model, max_epochs=2)
    assert assert_files_match_expected(io) == 16
    assert "current_model_state" in load(next(iter(io.expected)))


class ManualTwoOptimizers(TinyGPT):
    """Manual optimization, two optimizers, and ModelCheckpoint's pre-step state swap path."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(self.hparams.dim, self.hparams.dim)
        self.saved_models: dict[int, dict[str, torch.Tensor]] = {}

    def training_step(self, batch: Any, batch_idx: int) -> None:
        opt_a, opt_b = self.optimizers()
        self.saved_models[batch_idx] = {k: v.detach().clone() for k, v in self.layer.state_dict().items()}
        loss = self.loss(batch) + self.layer(self.tok.weight).pow(2).mean()
        opt_a.zero_grad()
        opt_b.zero_grad()
        self.manual_backward(loss)
        opt_a.step()
        opt_b.step()
        self.lr_schedulers().step()

    def configure_optimizers(self) -> Any:
        main = [p for n, p in self.named_parameters() if not n.startswith("layer.")]
        opt_a = torch.optim.AdamW(main, lr=1e-3)
        opt_b = torch.optim.SGD(self.layer.parameters(), lr=0.1, momentum=0.9)
        return [opt_a, opt_b], [torch.optim.lr_scheduler.StepLR(opt_a, 2)]


def test_manual_optimization_two_optimizers_and_state_swap(tmp_path: Any) -> None:
    io = RecordingLazyIO()
    model = ManualTwoOptimizers(dim=256)
    fit(tmp_path, io, [every_step(tmp_path / "ck")], model=model, max_epochs=1)
    assert assert_files_match_expected(io) == 8
    ck = load(next(iter(io.expected)))
    assert len(ck["optimizer_states"]) == 2 and "layer.weight" in ck["state_dict"]


# -- loggers and telemetry ---------------------------------------------------------------------------


class FileCheckingLogger(Logger):
    """A third-party logger that reads the checkpoint file in after_save_checkpoint."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[bool] = []

    @property
    def name(self) -> str:
        return "files"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        path = checkpoint_callback._last_checkpoint_saved
        self.seen.append(os.path.isfile(path) and load(path)["global_step"] >= 0)


def test_loggers_see_existing_files_and_get_stats(tmp_path: Any) -> None:
    files, csv_logger = FileCheckingLogger(), CSVLogger(tmp_path, name="csv")
    io = LazyCheckpointIO()
    fit(tmp_path, io, [every_step(tmp_path / "ck")], max_epochs=1, logger=[csv_logger, files])
    assert files.seen == [True] * 8
    with open(os.path.join(csv_logger.log_dir, "metrics.csv")) as f:
        rows = [r for r in csv.DictReader(f) if r.get("lazyckpt/stall_s")]
    assert len(rows) == len(io.stats) == 8
    assert all(float(r["lazyckpt/write_gbps"]) > 0 and float(r["lazyckpt/gbytes"]) > 0 for r in rows)


# -- fsspec URLs -------------------------------------------------------------------------------------


def test_fsspec_memory_url_uploads_after_commit(tmp_path: Any) -> None:
    fsspec = pytest.importorskip("fsspec")
    fs = fsspec.filesystem("memory")
    config = dict(every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True)
    fit(tmp_path / "s", None, [ModelCheckpoint(dirpath="memory://lazyckpt-test/stock", **config)], max_epochs=1)
    io = RecordingLazyIO()
    fit(tmp_path / "l", io, [ModelCheckpoint(dirpath="memory://lazyckpt-test/lazy", **config)], max_epochs=1)
    names = lambda d: sorted(os.path.basename(p) for p in fs.ls(d, detail=False))  # noqa: E731
    assert names("/lazyckpt-test/lazy") == names("/lazyckpt-test/stock") and names("/lazyckpt-test/lazy")
    url = "memory://lazyckpt-test/lazy/last.ckpt"
    assert_same(io.expected[url][-1], io.load_checkpoint(url))
    fs.rm("/lazyckpt-test", recursive=True)


def test_unknown_url_fails_at_once(tmp_path: Any) -> None:
    io = LazyCheckpointIO()
    with pytest.raises(LazyCkptError, match="nosuchproto"):
        io.save_checkpoint({"x": torch.zeros(2)}, "nosuchproto://bucket/x.ckpt")
    io.teardown()


# -- Fabric ------------------------------------------------------------------------------------------


def test_fabric_saves_exact_state_and_load_drains(tmp_path: Any) -> None:
    io = RecordingLazyIO()
    fabric, model, opt = fabric_with_tiny_gpt(io)
    for step, batch in enumerate(model.module.train_dataloader()):
        loss = model.module.loss(batch)
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        fabric.save(tmp_path / f"step{step}.ckpt", {"model": model, "optimizer": opt, "step": step})
    state = fabric.load(tmp_path / "step7.ckpt")  # drains every pending save
    assert io.pending_paths() == set()
    assert state["step"] == 7
    assert assert_files_match_expected(io) == 8
    io.teardown()  # Fabric never calls it; releases the threads


def test_fabric_drains_at_interpreter_exit(tmp_path: Any) -> None:
    script = textwrap.dedent(
        f"""
        import torch, lightning as L
        from lazyckpt.lightning import LazyCheckpointIO
        fabric = L.Fabric(accelerator="cpu", devices=1, plugins=[LazyCheckpointIO()])
        model = torch.nn.Linear(1024, 1024)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = fabric.setup(model, opt)
        model(torch.randn(2, 1024)).sum().backward(); opt.step()
        for i in range(3):
            fabric.save({str(tmp_path)!r} + f"/c{{i}}.ckpt", {{"model": model, "optimizer": opt, "i": i}})
        # no wait, no teardown: interpreter exit must drain
        """
    )
    subprocess.run([sys.executable, "-c", script], check=True, timeout=90)
    for i in range(3):
        assert load(str(tmp_path / f"c{i}.ckpt"))["i"] == i


# -- compatibility -----------------------------------------------------------------------------------


def test_pytorch_lightning_package(tmp_path: Any) -> None:
    pl = pytest.importorskip("pytorch_lightning")
    from pytorch_lightning.callbacks import ModelCheckpoint as PLModelCheckpoint

    class Plain(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 8)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters())

        def train_dataloader(self) -> Any:
            return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)

    io = RecordingLazyIO()
    callback = PLModelCheckpoint(dirpath=tmp_path, every_n_train_steps=1, save_top_k=-1)
    trainer = pl.Trainer(plugins=[io], callbacks=[callback], **trainer_kwargs(max_epochs=1, deterministic=False))
    trainer.fit(Plain())
    assert assert_files_match_expected(io) == 4


def test_strategy_bypass_is_reported(tmp_path: Any) -> None:
    from lightning.pytorch.strategies import FSDPStrategy

    from lazyckpt.lightning._compat import bypass_reason as _bypass_reason

    assert "torch.distributed.checkpoint" in (_bypass_reason(FSDPStrategy(state_dict_type="sharded")) or "")
    assert _bypass_reason(FSDPStrategy(state_dict_type="full")) is None


def test_deepspeed_strategy_is_refused_never_silently_stock(tmp_path: Any) -> None:
    """DeepSpeedStrategy saves through its engine, never through CheckpointIO: the plugin's first call from
    it raises (the real strategy needs CUDA: tests/test_gpu.py runs it)."""
    io = LazyCheckpointIO()

    class DeepSpeedStrategy:  # the least the plugin looks at: its name and _checkpoint_io
        def __init__(self) -> None:
            self._checkpoint_io = io

        def remove_checkpoint(self, path: str) -> None:
            io.remove_checkpoint(path)

    with pytest.raises(SaveRefusedError, match=r"lazyckpt\.deepspeed\.install"):
        DeepSpeedStrategy().remove_checkpoint(str(tmp_path / "x"))
    io.teardown()


def test_plugin_pickles_for_spawn(tmp_path: Any) -> None:
    import pickle

    io = LazyCheckpointIO(writer_threads=2, fsync=False)
    clone = pickle.loads(pickle.dumps(io))
    clone.save_checkpoint({"x": torch.ones(3)}, str(tmp_path / "p.ckpt"))
    clone.teardown()
    assert load(str(tmp_path / "p.ckpt"))["x"].sum().item() == 3
    assert clone._options == CheckpointerOptions(writer_threads=2, fsync=False)
    assert threading.active_count() >= 1


def test_plugins_share_one_global_step_hook_that_is_never_removed() -> None:
    """A plugin collected by the GC must not remove a global optimizer hook: torch may be iterating
    that hook dict inside another optimizer.step() at that moment ("OrderedDict mutated")."""
    import gc

    from torch.optim.optimizer import _global_optimizer_pre_hooks

    LazyCheckpointIO()
    before = len(_global_optimizer_pre_hooks)
    for _ in range(5):
        io = LazyCheckpointIO()
        del io
    gc.collect()
    assert len(_global_optimizer_pre_hooks) == before


def test_link_waits_for_a_pending_save_to_the_link_path(tmp_path, monkeypatch):
    """save_last="link" replaces last.ckpt with a symlink outside CheckpointIO: a lazy save to last.ckpt
    still being written must land first, or its rename would put a stale file over the new link."""
    import types

    from lightning.pytorch.callbacks import ModelCheckpoint

    from lazyckpt.lightning._compat import link_after_pending as _link_after_pending
    from lazyckpt.lightning._compat import runtime_of
    from lazyckpt.storage import fs as _fs

    gate = threading.Event()
    real = _fs.pwrite_all
    monkeypatch.setattr(_fs, "pwrite_all", lambda fd, d, off: (gate.wait(30), real(fd, d, off))[1])
    plugin = LazyCheckpointIO()
    last, target = tmp_path / "last.ckpt", tmp_path / "epoch=0-step=2.ckpt"
    plugin.save_checkpoint({"w": torch.randn(1000)}, str(last))
    target.write_bytes(b"x")
    trainer = types.SimpleNamespace(is_global_zero=True, strategy=types.SimpleNamespace(barrier=lambda: None))
    import weakref

    link = _link_after_pending(ModelCheckpoint._link_checkpoint, weakref.ref(runtime_of(plugin)))
    t = threading.Thread(target=link, args=(trainer, str(target), str(last)))
    t.start()
    t.join(0.2)
    assert t.is_alive(), "the link waits for the pending save to last.ckpt"
    gate.set()
    t.join(30)
    assert os.path.islink(last) and os.readlink(last) == target.name
    plugin.teardown()
