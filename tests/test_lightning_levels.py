"""MultiLevelCheckpoint (issue 22, Lightning): real Trainer runs, compared with stock and uninterrupted runs."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

import lazyckpt  # noqa: E402
from _launch import launch, rank_env, run_session  # noqa: E402
from lazyckpt import Level, LevelError, SaveRefusedError  # noqa: E402
from lazyckpt.lightning import LazyCheckpointIO, MultiLevelCheckpoint  # noqa: E402
from lazyckpt.storage import fs as _fs  # noqa: E402
from lightning_scripts.levels_gpt import StepGPT, StockSaves, TwoOptimizerGPT, level_trainer, state_of  # noqa: E402
from lightning_scripts.tiny_gpt import RecordingLazyIO, assert_files_match_expected, assert_same, load  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
if sys.platform != "linux":  # memory levels on /dev/shm
    pytestmark.append(pytest.mark.skip(reason="memory levels on /dev/shm"))


def _fit(levels: list[Level], steps: int, ckpt_path: str | None = None, model: Any = None, io: Any = None,
         extra: list[Any] | None = None, **kwargs: Any) -> Any:  # fmt: skip
    torch.manual_seed(0)
    model = (model or StepGPT)(batches=4)  # made after the seed: every run starts from the same weights
    io = io if io is not None else LazyCheckpointIO()
    trainer = level_trainer([MultiLevelCheckpoint(levels), *(extra or [])], [io], max_steps=steps, **kwargs)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer


def _steps(folder: Any) -> list[int]:
    return sorted(int(n[5:-3]) for n in os.listdir(folder) if n.startswith("step-") and n.endswith(".pt"))


def _uninterrupted(tmp_path: Any, steps: int, model: Any = None, **kwargs: Any) -> tuple[Level, Any]:
    """A run with one level keeping every step: the reference an interrupted run must equal."""
    ref = Level(tmp_path / "reference", every=1)
    return ref, _fit([ref], steps, model=model, **kwargs)


def test_each_level_holds_what_stock_save_checkpoint_writes_with_one_staging_per_step(mem, tmp_path):
    """A stock run saving with trainer.save_checkpoint at every step is the reference: each level's
    file of a step is that stock file's content; one core save per step whatever the levels due."""
    torch.manual_seed(0)
    level_trainer([StockSaves(str(tmp_path / "stock"))], [], max_steps=9).fit(StepGPT(batches=4))
    levels = [Level(mem, every=1, keep=3), Level(tmp_path / "disk", every=3)]
    io = LazyCheckpointIO()
    trainer = _fit(levels, 9, io=io)
    assert trainer.global_step == 9
    assert _steps(mem) == [7, 8, 9] and _steps(tmp_path / "disk") == [3, 6, 9]
    for level in levels:
        for step in _steps(level.path):
            assert_same(load(level.file(step)), load(str(tmp_path / "stock" / f"step-{step:08d}.ckpt")), f"{step}")
    assert len(io.stats) == 9  # one save (one staging) per step; the disk level copied the memory file
    with open(levels[0].file(9), "rb") as a, open(levels[1].file(9), "rb") as b:
        assert a.read() == b.read()


def test_resume_from_latest_continues_exactly_as_an_uninterrupted_run(mem, tmp_path):
    ref, whole = _uninterrupted(tmp_path, 10)
    levels = [Level(mem, every=1, keep=2), Level(tmp_path / "disk", every=4, keep=2)]
    _fit(levels, 6)
    found = lazyckpt.latest(levels)
    assert found is not None and (found.step, found.level) == (6, 0)
    assert found.preread is not None and found.preread.nbytes > 0  # latest() read it ahead
    resumed = _fit(levels, 10, ckpt_path=found.path)  # stock Lightning resumes: one line
    assert found.preread.nbytes == 0  # the plugin freed it before the stock load of that path
    assert_same(state_of(resumed), state_of(whole))
    for step in (9, 10):
        assert_same(load(levels[0].file(step)), load(ref.file(step)), f"memory {step}")
    assert _steps(tmp_path / "disk") == [4, 8]  # keep=2 across both fits
    assert_same(load(levels[1].file(8)), load(ref.file(8)), "disk 8")


class _Batches(Callback):
    """Counts the training batches this fit ran."""

    def __init__(self) -> None:
        self.count = 0

    def on_train_batch_end(self, *args: Any) -> None:
        self.count += 1


def _resumable_fit(levels: list[Level], steps: int, ckpt_path: str | None = None) -> tuple[Any, Any, int]:
    torch.manual_seed(0)
    model = StepGPT(batches=4)
    callback, batches = MultiLevelCheckpoint(levels, resume=True), _Batches()
    trainer = level_trainer([callback, batches], [LazyCheckpointIO()], max_steps=steps)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, callback, batches.count


def test_resume_true_restores_the_newest_step_at_setup_or_starts_fresh(mem, tmp_path, caplog):
    """``MultiLevelCheckpoint(levels, resume=True)`` and a bare ``fit(model)``: nothing in the levels ->
    a fresh start; then the newest step (memory) -> exactly an uninterrupted run; memory wiped -> the
    disk level's step; an explicit ``ckpt_path`` wins, with a warning."""
    ref, whole = _uninterrupted(tmp_path, 10)
    levels = [Level(mem, every=1, keep=2), Level(tmp_path / "disk", every=3, keep=2)]
    trainer, callback, ran = _resumable_fit(levels, 6)
    assert callback.resumed_from is None and trainer.global_step == 6 and ran == 6
    trainer, callback, ran = _resumable_fit(levels, 10)
    assert (callback.resumed_from.step, callback.resumed_from.level) == (6, 0)
    assert trainer.global_step == 10 and ran == 4  # steps 7..10 only
    assert_same(state_of(trainer), state_of(whole))
    shutil.rmtree(mem)  # a reboot: the disk level's step 9
    trainer, callback, ran = _resumable_fit(levels, 10)
    assert (callback.resumed_from.step, callback.resumed_from.level) == (9, 1) and ran == 1
    assert_same(state_of(trainer), state_of(whole))
    with caplog.at_level("WARNING", logger="lazyckpt.lightning._levels"):
        trainer, callback, ran = _resumable_fit(levels, 10, ckpt_path=str(ref.file(7)))
    assert callback.resumed_from.step == 10 and ran == 3  # step 7's file won: steps 8 to 10 again
    assert "was restored, not step 10" in caplog.text
    assert_same(state_of(trainer), state_of(whole))


class _SetupFails(Callback):
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        raise RuntimeError("a later callback's setup failed")


def test_resume_true_forgets_its_load_when_fit_raises_before_the_restore(mem, tmp_path):
    """The callback loads at its ``setup``; a later callback's ``setup`` raises before the Trainer
    restores: the loaded checkpoint must not stay in the Trainer's connector (a later ``validate`` or
    ``fit`` on that Trainer would restore it)."""
    levels = [Level(mem, every=1, keep=2)]
    _resumable_fit(levels, 3)
    torch.manual_seed(0)
    model = StepGPT(batches=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    callback = MultiLevelCheckpoint(levels, resume=True)
    trainer = level_trainer([callback, _SetupFails()], [LazyCheckpointIO()], max_steps=5)
    with pytest.raises(RuntimeError, match="later callback's setup failed"):
        trainer.fit(model)
    assert callback.resumed_from is not None and callback.resumed_from.step == 3  # it had loaded step 3
    connector = trainer._checkpoint_connector
    assert connector._loaded_checkpoint == {} and connector._ckpt_path is None
    connector.restore_model()  # what a later run's restore would apply: nothing
    assert_same(model.state_dict(), before)
    # only this fit's own pending load is forgotten: not another path, not after a restore ended
    from types import SimpleNamespace

    from lazyckpt.lightning import _compat

    for held, path in (({"state": 1}, "/given.ckpt"), ({}, None)):
        other = SimpleNamespace(
            ckpt_path=path, _checkpoint_connector=SimpleNamespace(_loaded_checkpoint=held, _ckpt_path=path)
        )
        _compat.forget_loaded(other, callback.resumed_from.path)
        assert other._checkpoint_connector._loaded_checkpoint == held and other._checkpoint_connector._ckpt_path == path


def test_resume_true_is_refused_with_a_strategy_that_restores_after_its_setup(tmp_path):
    """DCP-saving strategies, and any whose ``restore_checkpoint_after_setup`` (FSDP's full state
    dicts): their restore loads into the set-up model, after the callback's setup: a ValueError
    naming the way that works (``ckpt_path=lazyckpt.latest(levels).path``), before anything is read."""
    from types import SimpleNamespace

    callback = MultiLevelCheckpoint([Level(tmp_path / "mem", every=1)], resume=True)
    callback._sharded = True  # what setup finds for ModelParallelStrategy
    trainer = SimpleNamespace(strategy=SimpleNamespace(restore_checkpoint_after_setup=False))
    with pytest.raises(ValueError, match=r"ckpt_path=lazyckpt.latest\(levels\).path"):
        callback._resume(trainer)
    callback._sharded = False  # FSDPStrategy with full state dicts: restores after its setup too
    trainer = SimpleNamespace(strategy=SimpleNamespace(restore_checkpoint_after_setup=True))
    with pytest.raises(ValueError, match="SimpleNamespace: its restore loads into the set-up model"):
        callback._resume(trainer)
    assert callback.resumed_from is None


def test_memory_level_wiped_resumes_from_the_disk_level(mem, tmp_path):
    ref, whole = _uninterrupted(tmp_path, 10)
    levels = [Level(mem, every=1, keep=2), Level(tmp_path / "disk", every=3)]
    _fit(levels, 7)
    shutil.rmtree(mem)  # a reboot
    found = lazyckpt.latest(levels)
    assert found is not None and (found.step, found.level) == (6, 1)
    assert_same(load(found.path), load(ref.file(6)))
    resumed = _fit(levels, 10, ckpt_path=found.path)
    assert_same(state_of(resumed), state_of(whole))
    assert _steps(mem) == [9, 10] and _steps(tmp_path / "disk") == [3, 6, 9]


def test_gradient_accumulation_saves_each_optimizer_step_once(mem, tmp_path):
    """2 batches per optimizer step, 2 steps per epoch: each step saved once; every=2 saves at the
    last batch of each epoch. Resuming from there gives what stock Lightning's own resume from its
    own file of that step gives: the uninterrupted run's state but Lightning's epoch counters
    ``epoch_progress.*.ready/started`` (stock counts the start of the epoch after a restart at an
    epoch's last batch once less; training itself is the same)."""
    ref, whole = _uninterrupted(tmp_path, 6, accumulate_grad_batches=2)
    assert _steps(ref.path) == [1, 2, 3, 4, 5, 6]  # 12 batches, 6 steps, each saved once
    for step in _steps(ref.path):
        assert load(ref.file(step))["global_step"] == step
    levels = [Level(mem, every=2, keep=3)]
    _fit(levels, 3, accumulate_grad_batches=2)
    assert _steps(mem) == [2]
    resumed = _fit(levels, 6, ckpt_path=lazyckpt.latest(levels).path, accumulate_grad_batches=2)
    assert _steps(mem) == [2, 4, 6]
    torch.manual_seed(0)
    stock = level_trainer([StockSaves(str(tmp_path / "stock"))], [], max_steps=3, accumulate_grad_batches=2)
    stock.fit(StepGPT(batches=4))
    assert_same(load(levels[0].file(2)), load(str(tmp_path / "stock" / "step-00000002.ckpt")))
    torch.manual_seed(0)
    stock = level_trainer([], [], max_steps=6, accumulate_grad_batches=2)
    stock.fit(StepGPT(batches=4), ckpt_path=str(tmp_path / "stock" / "step-00000002.ckpt"))
    assert_same(state_of(resumed), state_of(stock))
    got, want = state_of(resumed), state_of(whole)
    counts, want_counts = got["loops"]["fit_loop"]["epoch_progress"], want["loops"]["fit_loop"]["epoch_progress"]
    for part in ("total", "current"):  # stock's counts, as above; the rest as uninterrupted
        assert (counts[part]["ready"], counts[part]["started"]) == (2, 2) and want_counts[part]["ready"] == 3
    got["loops"]["fit_loop"]["epoch_progress"] = want_counts
    assert_same(got, want)


def test_two_optimizers_a_level_is_due_when_its_multiple_is_passed(mem, tmp_path):
    """Manual optimization with two optimizers: global_step goes 2, 4, 6, ... A level with every=3
    saves at the first batch end at or past each multiple of 3 (4, 6, 10, 12), named by the step."""
    ref, whole = _uninterrupted(tmp_path, 12, model=TwoOptimizerGPT)
    assert _steps(ref.path) == [2, 4, 6, 8, 10, 12]
    levels = [Level(mem, every=3, keep=4)]
    _fit(levels, 6, model=TwoOptimizerGPT)
    assert _steps(mem) == [4, 6]
    resumed = _fit(levels, 12, ckpt_path=lazyckpt.latest(levels).path, model=TwoOptimizerGPT)
    assert _steps(mem) == [4, 6, 10, 12]
    assert_same(state_of(resumed), state_of(whole))
    for step in (10, 12):
        assert_same(load(levels[0].file(step)), load(ref.file(step)), str(step))
        assert len(load(ref.file(step))["optimizer_states"]) == 2


def _full_disk(monkeypatch: Any, disk: str) -> None:
    real = _fs.open_temporary

    def full(tmp: str, size: int) -> int:
        if tmp.startswith(disk):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(tmp, size)

    monkeypatch.setattr(_fs, "open_temporary", full)


class _RaisedAt(Callback):
    """Records the global step at which ``fit`` raised."""

    def __init__(self) -> None:
        self.step: int | None = None

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self.step = trainer.global_step


@pytest.mark.parametrize("early", [False, True], ids=["as-it-comes", "copy-failed-before-the-raise"])
def test_failing_disk_level_raises_level_error_once_memory_level_keeps_working(mem, tmp_path, monkeypatch, early):
    """The disk level's ENOSPC is raised once, from fit, at the first due step after it is seen, and
    only after that step was handed to the memory level. ``early``: each step's copies are let end
    before the callback looks for errors, so the failed copy of step 2 is raised at step 2 itself."""
    from lazyckpt.lightning._runtime import PluginRuntime

    if early:
        real_raise = PluginRuntime.raise_errors

        def settled_first(self: Any) -> None:
            self.settle_levels(60)
            real_raise(self)

        monkeypatch.setattr(PluginRuntime, "raise_errors", settled_first)
    disk = str(tmp_path / "disk")
    _full_disk(monkeypatch, disk)
    levels = [Level(mem, every=1, keep=3), Level(disk, every=2)]
    io, raised = LazyCheckpointIO(), _RaisedAt()
    with pytest.raises(LevelError) as info:
        _fit(levels, 12, io=io, extra=[raised])
    err = info.value
    assert err.level == 1 and err.level_path == disk and err.errno == errno.ENOSPC and err.step % 2 == 0
    assert "level 1" in str(err) and isinstance(err.__cause__, OSError)
    assert os.listdir(disk) == []  # no partial file, no temporary
    newest = _steps(mem)[-1]
    assert raised.step is not None and err.step <= raised.step
    assert newest == raised.step  # the step it was raised at was handed to the memory level first
    if early:
        assert err.step == raised.step == 2
    monkeypatch.undo()
    io.wait()  # reported once: nothing left to raise
    found = lazyckpt.latest(levels)
    assert found is not None and (found.step, found.level) == (newest, 0)
    assert _fit(levels, 12, ckpt_path=found.path).global_step == 12
    assert _steps(disk) == [s for s in range(newest + 1, 13) if s % 2 == 0]


class _TeardownSignal(LazyCheckpointIO):
    """Sets ``started`` when the strategy's teardown reaches the plugin."""

    def __init__(self) -> None:
        super().__init__()
        self.started = threading.Event()

    def teardown(self) -> None:
        self.started.set()
        super().teardown()


def test_teardown_drains_a_level_copy_still_running_and_raises_its_error(mem, tmp_path, monkeypatch):
    """The last disk copy is held until teardown has begun, then fails: fit() must raise it (the
    plugin drains its level savers before closing them; without that the error is lost)."""
    from lazyckpt.lightning import _levels as _plugin_levels
    from lazyckpt.schedule import _copy

    io = _TeardownSignal()
    entered, draining = threading.Event(), threading.Event()
    real_drain = _plugin_levels.PluginLevels.drain

    def drain(self, timeout=None):  # the end of fit (finalize or teardown) drains the level savers here
        draining.set()
        return real_drain(self, timeout)

    monkeypatch.setattr(_plugin_levels.PluginLevels, "drain", drain)

    def held(src: str, dst: str, fsync: bool) -> None:
        if dst.endswith(f"step-{4:08d}.pt"):
            entered.set()
            assert draining.wait(60), "the end of fit never drained the levels"
            raise OSError(errno.ENOSPC, "No space left on device")
        real(src, dst, fsync)

    real = _copy.copy_file
    monkeypatch.setattr(_copy, "copy_file", held)
    levels = [Level(mem, every=1, keep=4), Level(tmp_path / "disk", every=2)]
    with pytest.raises(LevelError, match="step 4"):
        _fit(levels, 4, io=io)
    assert entered.is_set() and _steps(tmp_path / "disk") == [2]


def test_model_checkpoint_and_other_saves_alongside(mem, tmp_path):
    io = RecordingLazyIO()
    ckpt = ModelCheckpoint(dirpath=tmp_path / "mc", every_n_train_steps=2, save_top_k=2, monitor="step",
                           mode="max", save_last=True)  # fmt: skip
    levels = [Level(mem, every=1, keep=2), Level(tmp_path / "disk", every=3, keep=1)]
    torch.manual_seed(0)
    trainer = level_trainer([MultiLevelCheckpoint(levels), ckpt], [io], max_steps=8, enable_checkpointing=True)
    trainer.fit(StepGPT(batches=4))
    trainer.save_checkpoint(tmp_path / "after.ckpt")  # a plain save after fit, durable at return
    assert sorted(os.listdir(tmp_path / "mc")) == ["epoch=1-step=6.ckpt", "epoch=1-step=8.ckpt", "last.ckpt"]
    assert assert_files_match_expected(io) == 4  # ModelCheckpoint's files and the save after fit
    assert _steps(mem) == [7, 8] and _steps(tmp_path / "disk") == [6]
    mc_state = load(str(tmp_path / "mc" / "epoch=1-step=8.ckpt"))
    mine = load(levels[0].file(8))
    assert_same({k: v for k, v in mine.items() if k != "callbacks"},
                {k: v for k, v in mc_state.items() if k != "callbacks"})  # fmt: skip
    assert len(io.stats) == 8 + 2 * 4 + 1  # every step (levels), every 2nd step twice (top-k, last), after fit


def test_refusals_and_no_saves_outside_fit(mem, tmp_path):
    levels = [Level(mem, every=1, keep=1)]
    trainer = level_trainer([MultiLevelCheckpoint(levels)], [], max_steps=2)
    with pytest.raises(TypeError, match="LazyCheckpointIO"):
        trainer.fit(StepGPT(batches=4))
    with pytest.raises(ValueError, match="share a path"):
        MultiLevelCheckpoint([Level(mem), Level(mem, every=2)])
    with pytest.raises(TypeError):
        MultiLevelCheckpoint([mem])  # type: ignore[list-item]
    io = LazyCheckpointIO()
    trainer = level_trainer([MultiLevelCheckpoint(levels)], [io], max_steps=2, limit_val_batches=2)
    model = StepGPT(batches=4, val_batches=2)
    trainer.validate(model)
    trainer.test(model, dataloaders=model.val_dataloader())
    assert not os.path.exists(mem) or os.listdir(mem) == []
    assert io.checkpointer is None  # nothing saved, no thread started


def test_strategies_that_bypass_checkpoint_io_are_refused_but_the_sharded_ones_served(mem):
    """DeepSpeed saves through its engine: refused. ModelParallelStrategy (DCP folders) is served by
    every rank's sharded save (tests/test_lightning_levels_sharded.py runs it)."""
    from lazyckpt.lightning import _levels
    from lazyckpt.lightning._compat import runtime_of

    def trainer_with(name: str, **attrs: Any) -> Any:  # the least a Trainer needs for the check
        strategy = type(name, (), {"__module__": "lightning.pytorch.strategies", **attrs})()
        strategy.checkpoint_io = LazyCheckpointIO()
        return type("Trainer", (), {"strategy": strategy})()

    with pytest.raises(SaveRefusedError, match="DeepSpeed"):
        _levels._runtime_of(trainer_with("DeepSpeedStrategy"))
    served = trainer_with("ModelParallelStrategy", _save_distributed_checkpoint=True)
    assert _levels._runtime_of(served) is runtime_of(served.strategy.checkpoint_io)


# -- real processes ---------------------------------------------------------------------------------

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(TESTS, "lightning_scripts")


def _run_script(args: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a script with Lightning's launcher starting the other ranks (``_launch.run_session``)."""
    return run_session(args, timeout, rank_env({"PYTHONPATH": os.path.dirname(TESTS)}, drop=("LOCAL_RANK",)))


@pytest.mark.slow(reason="a loop of Lightning fits in child processes, each SIGKILLed, then resumed to the end")
@pytest.mark.timeout(400)
def test_sigkilled_fits_resume_from_latest_and_end_as_an_uninterrupted_run(mem, tmp_path):
    """10 Lightning fits SIGKILLed at random points (a memory-level wipe after every 4th), each
    resumed by stock Lightning from latest(); see tests/lightning_scripts/levels_kill.py."""
    expect, results = tmp_path / "expect", tmp_path / "results.jsonl"
    expect.mkdir()
    args = [os.path.join(SCRIPTS, "levels_kill.py"), mem, str(tmp_path / "disk"), str(expect), str(results),
            "10", "3", "500"]  # fmt: skip
    proc = _run_script(args, timeout=360)
    assert proc.returncode == 0, proc.stdout[-4000:]
    entries = [json.loads(line) for line in results.read_text().splitlines()]
    assert all(e["ok"] for e in entries), entries  # a child killed before its check wrote none
    assert 7 <= len(entries) <= 12
    assert entries[-1] == {"final": True, "ok": True, "step": 500}
    found = [e["found"] for e in entries[:-1] if e.get("found")]
    assert len(found) >= 6 and any(level == 1 for _, level in found), found  # some resumed from the disk level


def _ddp(tmp_path: Any, mode: str) -> tuple[subprocess.CompletedProcess[str], list[dict[str, Any]]]:
    proc = _run_script([os.path.join(SCRIPTS, "levels_ddp.py"), str(tmp_path), mode], timeout=240)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    return proc, reports


@pytest.mark.slow(reason="two-process Lightning DDP fit, then a second fit resuming from it")
@pytest.mark.timeout(300)
def test_ddp_two_processes_resume_exactly_with_model_checkpoint(tmp_path):
    proc, (rank0, rank1) = _ddp(tmp_path, "resume")
    assert proc.returncode == 0, proc.stdout[-4000:]
    for report in (rank0, rank1):  # every rank resumed from the same file and ends as uninterrupted
        assert report["found"] == [5, 0] and report["global_step"] == 10 and report["same_as_uninterrupted"]
    assert rank0["saves"] > 0 and rank1["saves"] == 0  # only rank 0 reaches the plugin
    assert rank0["files_same"] == [True, True, True]
    assert _steps(tmp_path / "mem") == [9, 10] and _steps(tmp_path / "disk") == [6, 9]
    assert sorted(os.listdir(tmp_path / "mc")) == ["epoch=1-step=8.ckpt", "epoch=2-step=10.ckpt", "last.ckpt"]


@pytest.mark.slow(reason="a two-process Lightning DDP fit with a failing level")
@pytest.mark.timeout(300)
def test_ddp_level_error_is_raised_on_every_rank_at_once(tmp_path):
    proc, reports = _ddp(tmp_path, "enospc")
    assert proc.returncode != 0
    for report in reports:  # both ranks raise LevelError naming level 1 at the same batch: no rank waits
        assert report["raised"] == "LevelError" and report["level"] == 1, report
        assert "level 1" in report["message"] and "No space left" in report["message"]
    assert os.listdir(tmp_path / "disk") == []


@pytest.mark.slow(reason="two-process Lightning DDP fit with replicas, a node's memory wiped, then a resumed fit")
@pytest.mark.timeout(420)
def test_ddp_with_replicas_a_lost_nodes_memory_comes_back_from_the_other_node(tmp_path):
    """Issue 37 items 3-4 through Lightning DDP (rank 0 alone writes single-file checkpoints): 2 ranks
    standing for 2 nodes, ``Level(mem/node<r>, replicas=1)``. Node 1 holds rank 0's steps; node 0's
    memory lost, a fresh job's ``latest(levels)`` (collective, before ``fit``) puts step 5 back into
    node 0's folder and both ranks resume from the memory level exactly; both memories lost: the
    disk level."""
    script, env = Path(SCRIPTS) / "levels_replicas.py", {"PYTHONPATH": os.path.dirname(TESTS)}  # + benchmarks/
    first = launch(script, "first", 2, tmp_path, timeout=300, env=env)
    assert all(r["global_step"] == 5 and not r.get("warnings") for r in first), first
    reference = first[0]["reference"]
    mem = tmp_path / "memr"
    assert _steps(mem / "node0") == [4, 5] and _steps(mem / "node1") == [4, 5]  # node 1: rank 0's copies
    for step in (4, 5):
        assert lazyckpt.verify(mem / "node1" / f"step-{step:08d}.pt").ok
    shutil.rmtree(mem / "node0")  # node 0 replaced: its memory is empty
    os.makedirs(mem / "node0")
    resumed = launch(script, "resume", 2, tmp_path, timeout=300, env=env)
    for r in resumed:  # from the memory level (node 0: the copy node 1 sent back), exactly
        assert r["found"] == [5, 0] and r["global_step"] == 10 and r["digest"] == reference, r
        assert not r.get("warnings"), r
    assert _steps(mem / "node0") == [9, 10] and _steps(mem / "node1") == [9, 10]
    for node in ("node0", "node1"):  # both memories lost: the disk level (step 9), never a step some rank lacks
        shutil.rmtree(mem / node)
        os.makedirs(mem / node)
    again = launch(script, "resume", 2, tmp_path, timeout=300, env=env)
    assert all(r["found"] == [9, 1] and r["digest"] == reference for r in again), again


@pytest.mark.slow(reason="two-process Lightning DDP fits (save, wipe, resume)")
def test_ddp_resume_true_restores_a_lost_node_when_lightning_makes_the_process_group(tmp_path):
    """No process group before ``fit`` (Lightning makes it, as under its own launcher or SLURM):
    ``MultiLevelCheckpoint(levels, resume=True)`` agrees on the step at setup (collective), node 0's
    emptied memory gets step 5 back from node 1, and both ranks resume exactly; both emptied: the
    disk level's step 9 (every rank the same)."""
    script, env = Path(SCRIPTS) / "levels_replicas.py", {"PYTHONPATH": os.path.dirname(TESTS)}
    first = launch(script, "first", 2, tmp_path, timeout=300, env=env)
    reference = first[0]["reference"]
    mem = tmp_path / "memr"
    shutil.rmtree(mem / "node0")
    os.makedirs(mem / "node0")
    resumed = launch(script, "resume_in_fit", 2, tmp_path, timeout=300, env=env)
    for r in resumed:
        assert r["found"] == [5, 0] and r["global_step"] == 10 and r["digest"] == reference, r
        assert not r.get("warnings"), r
    for node in ("node0", "node1"):
        shutil.rmtree(mem / node)
        os.makedirs(mem / node)
    again = launch(script, "resume_in_fit", 2, tmp_path, timeout=300, env=env)
    assert all(r["found"] == [9, 1] and r["digest"] == reference for r in again), again


@pytest.mark.slow(reason="two-process Lightning DDP fits (save, wipe, resume)")
def test_ddp_resume_true_without_replicas_agrees_on_a_step_every_rank_can_load(tmp_path):
    """Node-local memory without replicas: rank 0's node holds steps 4 and 5, node 1's memory
    nothing. ``resume=True`` makes the ranks agree (collective ``latest``): both resume from the disk
    level's step 3, exactly; each rank's own newest would be 5 on rank 0 and 3 on rank 1."""
    script, env = Path(SCRIPTS) / "levels_replicas.py", {"PYTHONPATH": os.path.dirname(TESTS)}
    first = launch(script, "first_plain", 2, tmp_path, timeout=300, env=env)
    mem = tmp_path / "memr"
    assert _steps(mem / "node0") == [4, 5] and not (mem / "node1").exists(), first
    resumed = launch(script, "resume_in_fit_plain", 2, tmp_path, timeout=300, env=env)
    for r in resumed:
        assert r["found"] == [3, 1] and r["global_step"] == 10 and r["digest"] == first[0]["reference"], r


def test_replicas_without_a_distributed_job_are_a_value_error_at_fit(tmp_path):
    """``replicas`` needs other nodes: one process is refused when the saver is built (fit's setup),
    before any step."""
    levels = [Level(str(tmp_path / "mem"), every=1, replicas=1), Level(str(tmp_path / "disk"), every=2)]
    with pytest.raises(ValueError, match="replicas=1 needs torch.distributed"):
        _fit(levels, 2)
    assert not (tmp_path / "mem").exists() or _steps(tmp_path / "mem") == []
