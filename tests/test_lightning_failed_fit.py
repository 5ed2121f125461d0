"""Nothing outlives a failed fit (issue 39): real Trainers on CPU with a TensorBoard logger.

Lightning's failure path (``trainer/call.py``) finalizes the loggers before it tears the strategy
down, so the plugin's teardown comes after the loggers were closed. A logger written to after its
``finalize`` reopens: TensorBoard's SummaryWriter starts a new writer thread and a new event file,
which (same second, same name) truncates the flushed one. Each test runs the same failing fit with
the stock plugin and with ``LazyCheckpointIO`` and compares: the threads left (none), the logger's
writer closed, its event file complete and holding stock's scalars, the same checkpoint files with
the same contents, nothing pending.
"""

from __future__ import annotations

import glob
import os
import signal
import struct
import threading
from dataclasses import dataclass
from typing import Any

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.callbacks import ModelCheckpoint, OnExceptionCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from lightning.pytorch.loggers import TensorBoardLogger  # noqa: E402

from lazyckpt.lightning import LazyCheckpointIO  # noqa: E402

try:  # the writer Lightning picks: torch's (needs `tensorboard`), else tensorboardX's
    from tensorboard.compat.proto.event_pb2 import Event
except ImportError:
    Event = pytest.importorskip("tensorboardX.proto.event_pb2").Event

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

JOIN_S = 10.0  # a closed writer's threads end on their own: the longest we wait on each handle


class Logged(BoringModel):
    """BoringModel that logs its losses (so the event file has something to lose) and fails on cue."""

    fail: str = ""  # "validation" (second epoch), "train" (at step 3) or "interrupt" (at step 3)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        if self.global_step == 3 and self.fail in ("train", "interrupt"):
            raise KeyboardInterrupt if self.fail == "interrupt" else RuntimeError("training failed at step 3")
        out = super().training_step(batch, batch_idx)
        self.log("train_loss", out["loss"])
        return out

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        if self.current_epoch == 1 and self.fail == "validation":
            raise RuntimeError("validation failed in epoch 1")
        out = super().validation_step(batch, batch_idx)
        self.log("val_loss", out["x"])
        return out


@dataclass
class Outcome:
    files: dict[str, dict[str, Any]]  # checkpoint name -> its contents (torch.load)
    threads: list[str]  # threads the fit left alive
    writer_closed: bool
    scalars: list[tuple[str, int]]  # (tag, step) of every scalar in the event files, lazyckpt's apart
    lazyckpt_scalars: list[tuple[str, int, float]]
    event_bytes: list[int]


def read_events(log_dir: str) -> tuple[list[Any], list[int]]:
    """Every record of the event files (TFRecord framing: length, its CRC, data, its CRC); a file cut
    short or holding a partial record fails here."""
    events, sizes = [], []
    for path in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        with open(path, "rb") as f:
            data = f.read()
        sizes.append(len(data))
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            assert pos + 12 + length + 4 <= len(data), f"{path}: a record cut short"
            event = Event()
            event.ParseFromString(data[pos + 12 : pos + 12 + length])
            events.append(event)
            pos += 12 + length + 4
    return events, sizes


def run(root: Any, io: LazyCheckpointIO | None, fail: str, callbacks: list[Any]) -> Outcome:
    L.seed_everything(0, verbose=False)
    model = Logged()
    model.fail = fail
    logger = TensorBoardLogger(root, name="tb")
    trainer = L.Trainer(
        default_root_dir=root, accelerator="cpu", devices=1, logger=logger, callbacks=callbacks,
        plugins=[io] if io is not None else [], max_epochs=3, limit_train_batches=2, limit_val_batches=1,
        num_sanity_val_steps=0, log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    before = set(threading.enumerate())
    sigint = signal.getsignal(signal.SIGINT)
    try:
        if fail == "interrupt":  # Lightning's interrupt handling: teardown, then exit(1)
            with pytest.raises(SystemExit) as exit_info:
                trainer.fit(model)
            assert exit_info.value.code == 1
        else:
            with pytest.raises(RuntimeError, match="failed"):
                trainer.fit(model)
        threads = left_alive(before)
        writer = logger._experiment
        writer_closed = writer is not None and writer.file_writer is None
    finally:
        signal.signal(signal.SIGINT, sigint)  # Lightning ignores SIGINT from its interrupt handling on
        if logger._experiment is not None:
            logger._experiment.close()  # a writer reopened after finalize must not outlive this test
    if io is not None:
        assert io.pending_paths() == set()
        assert io.checkpointer is None  # released at teardown
    ck = os.path.join(root, "ck")
    files = {name: torch.load(os.path.join(ck, name), weights_only=False) for name in sorted(os.listdir(ck))}
    events, sizes = read_events(logger.log_dir)
    values = [(v.tag, e.step, v.simple_value) for e in events for v in e.summary.value]
    return Outcome(
        files=files,
        threads=threads,
        writer_closed=writer_closed,
        scalars=sorted((tag, step) for tag, step, _ in values if not tag.startswith("lazyckpt/")),
        lazyckpt_scalars=[v for v in values if v[0].startswith("lazyckpt/")],
        event_bytes=sizes,
    )


def left_alive(before: set[threading.Thread]) -> list[str]:
    started = [t for t in threading.enumerate() if t not in before]
    for thread in started:
        thread.join(JOIN_S)
    return sorted(t.name for t in started if t.is_alive())


def assert_as_stock(
    stock: Outcome, lazy: Outcome, io: LazyCheckpointIO, files: dict[str, int], saved_at: list[int]
) -> None:
    """``files``: stock's checkpoint files and their steps; ``saved_at``: the step of each save made."""
    assert {name: f["global_step"] for name, f in stock.files.items()} == files
    assert stock.threads == [] and stock.writer_closed and stock.scalars  # the reference itself
    assert lazy.threads == stock.threads
    assert lazy.writer_closed
    assert len(lazy.event_bytes) == len(stock.event_bytes) == 1 and lazy.event_bytes[0] > 0
    assert lazy.scalars == stock.scalars
    assert list(lazy.files) == list(stock.files)  # no temporary file left either
    for name, expected in stock.files.items():
        got = lazy.files[name]
        assert got["global_step"] == expected["global_step"], name
        for key, value in expected["state_dict"].items():
            assert torch.equal(got["state_dict"][key], value), (name, key)
    # every save's telemetry reached the logger before Lightning closed it
    logged = [step for tag, _, step in lazy.lazyckpt_scalars if tag == "lazyckpt/saved_at_step"]
    assert sorted(logged) == saved_at and len(io.stats) == len(saved_at)


def test_fit_raising_in_validation_with_on_exception_checkpoint(tmp_path: Any) -> None:
    def callbacks(root: Any) -> list[Any]:
        ck = os.path.join(root, "ck")
        return [ModelCheckpoint(dirpath=ck, every_n_train_steps=1, save_top_k=-1), OnExceptionCheckpoint(ck)]

    stock = run(tmp_path / "stock", None, "validation", callbacks(tmp_path / "stock"))
    io = LazyCheckpointIO()
    lazy = run(tmp_path / "lazy", io, "validation", callbacks(tmp_path / "lazy"))
    files = {"epoch=0-step=1.ckpt": 1, "epoch=0-step=2.ckpt": 2, "epoch=1-step=3.ckpt": 3, "epoch=1-step=4.ckpt": 4}
    assert_as_stock(stock, lazy, io, {**files, "on_exception.ckpt": 4}, [1, 2, 3, 4, 4])


def test_fit_raising_with_save_last(tmp_path: Any) -> None:
    def callbacks(root: Any) -> list[Any]:
        ck = os.path.join(root, "ck")
        return [ModelCheckpoint(dirpath=ck, every_n_train_steps=1, save_top_k=2, monitor="step", mode="max",
                                save_last=True)]  # fmt: skip

    stock = run(tmp_path / "stock", None, "train", callbacks(tmp_path / "stock"))
    io = LazyCheckpointIO()
    lazy = run(tmp_path / "lazy", io, "train", callbacks(tmp_path / "lazy"))
    files = {"epoch=0-step=2.ckpt": 2, "epoch=1-step=3.ckpt": 3, "last.ckpt": 3}  # top 2 of 3, and last
    assert_as_stock(stock, lazy, io, files, [1, 1, 2, 2, 3, 3])


def test_fit_interrupted_by_keyboard_interrupt(tmp_path: Any) -> None:
    def callbacks(root: Any) -> list[Any]:
        return [ModelCheckpoint(dirpath=os.path.join(root, "ck"), every_n_train_steps=1, save_top_k=-1)]

    stock = run(tmp_path / "stock", None, "interrupt", callbacks(tmp_path / "stock"))
    io = LazyCheckpointIO()
    lazy = run(tmp_path / "lazy", io, "interrupt", callbacks(tmp_path / "lazy"))
    files = {"epoch=0-step=1.ckpt": 1, "epoch=0-step=2.ckpt": 2, "epoch=1-step=3.ckpt": 3}
    assert_as_stock(stock, lazy, io, files, [1, 2, 3])


def test_saves_after_a_finished_fit_leave_the_logger_closed(tmp_path: Any) -> None:
    io = LazyCheckpointIO()
    logger = TensorBoardLogger(tmp_path, name="tb")
    trainer = L.Trainer(
        default_root_dir=tmp_path, accelerator="cpu", devices=1, logger=logger, plugins=[io], max_epochs=1,
        limit_train_batches=2, limit_val_batches=1, num_sanity_val_steps=0, log_every_n_steps=1,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )  # fmt: skip
    before = set(threading.enumerate())
    try:
        trainer.fit(Logged())
        for name in ("a.ckpt", "b.ckpt", "c.ckpt"):  # each save outside fit finds the previous one's stats
            trainer.save_checkpoint(tmp_path / name)
        threads = left_alive(before)
        writer_closed = logger._experiment.file_writer is None
    finally:
        logger._experiment.close()
    assert threads == [] and writer_closed
    events, sizes = read_events(logger.log_dir)
    assert len(sizes) == 1 and sizes[0] > 0
    assert {v.tag for e in events for v in e.summary.value} >= {"train_loss", "val_loss"}
    assert len(io.stats) == 3 and all(os.path.isfile(tmp_path / n) for n in ("a.ckpt", "b.ckpt", "c.ckpt"))
