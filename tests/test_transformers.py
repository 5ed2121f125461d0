"""lazyckpt.transformers: a tiny Trainer run stock and installed must leave the same checkpoints.

Every comparison runs both trainers in the same output path one after the other (the stock run's
folder is moved aside), so that paths recorded inside the files (``best_model_checkpoint``, the
pickled ``TrainingArguments``) are equal too.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")

from tests._util import assert_same  # noqa: E402
from tests.transformers_scripts import tiny  # noqa: E402

import lazyckpt.transformers  # noqa: E402
from lazyckpt import Level  # noqa: E402
from lazyckpt.transformers import UnsupportedTrainerError, _compat  # noqa: E402

pytestmark = pytest.mark.integration
SCRIPTS = Path(__file__).parent / "transformers_scripts"
TIMING_KEYS = ("runtime", "per_second")


def run(out: Path, lazy: bool, *, moved_to: Path | None = None, setup: Any = None, **overrides: Any) -> dict:
    """Train a tiny Trainer in ``out`` (installed when ``lazy``); final weights; the folder moved to ``moved_to``."""
    tr = tiny.trainer(out, **overrides)
    if setup is not None:
        setup(tr)
    handle = lazyckpt.transformers.install(tr) if lazy else None
    tr.train()
    if handle is not None:
        assert handle.pending() == 0, "train() returned with a checkpoint not committed"
        handle.uninstall()
    weights = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    if moved_to is not None:
        shutil.move(str(out), str(moved_to))
    return weights


def stock_and_lazy(tmp_path: Path, **kw: Any) -> tuple[Path, Path]:
    out, stock, lazy = tmp_path / "out", tmp_path / "stock", tmp_path / "lazy"
    w_stock = run(out, False, moved_to=stock, **kw)
    w_lazy = run(out, True, moved_to=lazy, **kw)
    assert_same(w_lazy, w_stock, "final weights")
    return stock, lazy


def load_any(path: Path) -> Any:
    if path.suffix == ".safetensors":
        with safetensors_torch.safe_open(str(path), "pt") as f:
            meta = {k: v for k, v in (f.metadata() or {}).items() if not k.startswith("lazyckpt")}
        tensors = safetensors_torch.load_file(str(path))
        return {"tensors": dict(sorted(tensors.items())), "metadata": meta}
    if path.suffix == ".json":
        return _drop_timings(json.loads(path.read_text()))
    if path.name == "training_args.bin":
        return torch.load(path, weights_only=False).to_dict()
    if path.suffix in (".pt", ".pth", ".bin"):
        return torch.load(path, weights_only=False)
    return path.read_bytes()


def _drop_timings(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {k: _drop_timings(v) for k, v in obj.items() if not any(t in k for t in TIMING_KEYS)}
    if isinstance(obj, list):
        return [_drop_timings(v) for v in obj]
    return obj


def assert_same_checkpoints(stock: Path, lazy: Path) -> list[str]:
    """The same checkpoint-N folders, the same files, equal contents (tensors bitwise); their names."""
    names = sorted(p.name for p in stock.iterdir())
    assert sorted(p.name for p in lazy.iterdir()) == names, "surviving folders differ"
    for name in names:
        if not (stock / name).is_dir():
            continue
        files = sorted(p.name for p in (stock / name).iterdir())
        assert sorted(p.name for p in (lazy / name).iterdir()) == files, f"{name}: file lists differ"
        for f in files:
            assert_same(load_any(lazy / name / f), load_any(stock / name / f), f"{name}/{f}")
    return names


# -- the judge's comparison: same weights, same folders and contents, same resume ----------------------


def test_stock_and_installed_leave_the_same_checkpoints_and_resume_the_same(tmp_path: Path) -> None:
    stock, lazy = stock_and_lazy(tmp_path, save_total_limit=2)
    assert assert_same_checkpoints(stock, lazy) == ["checkpoint-4", "checkpoint-6"]
    # A stock Trainer (nothing installed) resumes from either folder: the same run.
    resumed = {}
    for name, src in (("stock", stock), ("lazy", lazy)):
        tr = tiny.trainer(tmp_path / f"resume-{name}", max_steps=9, save_steps=100)
        tr.train(resume_from_checkpoint=str(src / "checkpoint-4"))
        resumed[name] = ({k: v.clone() for k, v in tr.model.state_dict().items()}, tr.optimizer.state_dict())
    assert_same(resumed["lazy"], resumed["stock"], "resumed from checkpoint-4")


def test_resume_from_checkpoint_true_reads_the_lazy_folders(tmp_path: Path) -> None:
    out = tmp_path / "out"
    tr = tiny.trainer(out, max_steps=6, save_steps=2)
    handle = lazyckpt.transformers.install(tr)
    tr.train()
    handle.uninstall()
    uninterrupted = {k: v.clone() for k, v in tr.model.state_dict().items()}
    shutil.rmtree(out / "checkpoint-6")  # as if killed before step 6 was saved
    found = lazyckpt.transformers.latest(out)
    assert found.path == str(out / "checkpoint-4") and (found.step, found.level) == (4, 0)
    assert os.fspath(found) == found.path  # path-like: resume_from_checkpoint=found works too
    again = tiny.trainer(out, max_steps=6, save_steps=2)
    handle = lazyckpt.transformers.install(again)
    again.train(resume_from_checkpoint=True)  # stock get_last_checkpoint: checkpoint-4
    handle.uninstall()
    assert_same(dict(again.model.state_dict()), uninterrupted, "resumed vs uninterrupted")


@pytest.mark.parametrize(
    "case",
    [
        "save_only_model", "best_model_limit_1", "best_model_limit_2", "sharded", "plain_module", "grad_accum",
        "frozen", "buffer_changed_in_forward",
    ],
)  # fmt: skip
def test_stock_options_give_the_same_folders(tmp_path: Path, case: str) -> None:
    kw: dict[str, Any] = {}
    if case == "save_only_model":
        kw = dict(save_only_model=True, save_total_limit=2)
    elif case.startswith("best_model"):
        kw = dict(
            eval_strategy="steps", eval_steps=2, load_best_model_at_end=True, metric_for_best_model="eval_loss",
            greater_is_better=True,  # "best" is the highest loss: an early checkpoint stays best
            save_total_limit=int(case[-1]), max_steps=8,
        )  # fmt: skip
    elif case == "sharded":

        def setup(tr: Any) -> None:  # a model file split in shards + index, as big models are
            stock_save = tr.model.save_pretrained
            tr.model.save_pretrained = lambda *a, **k: stock_save(*a, max_shard_size="20KB", **k)

        kw = dict(setup=setup, save_total_limit=1)
    elif case == "plain_module":  # not a PreTrainedModel: Trainer._save calls safetensors.torch.save_file itself
        kw = dict(plain=True)
    elif case == "grad_accum":
        kw = dict(gradient_accumulation_steps=2, max_steps=4)
    elif case == "frozen":  # a parameter no optimizer owns: captured inside the save

        def setup(tr: Any) -> None:
            tr.model.transformer.wpe.weight.requires_grad_(False)

        kw = dict(setup=setup)
    elif case == "buffer_changed_in_forward":  # changed in place by the next forward, after the save returned

        def setup(tr: Any) -> None:
            tr.model.register_buffer("seen", torch.zeros(4))

            def count(module: Any, args: Any, kwargs: Any) -> None:
                module.seen.add_(1)

            tr.model.register_forward_pre_hook(count, with_kwargs=True)

        kw = dict(setup=setup)
    stock, lazy = stock_and_lazy(tmp_path, **kw)
    names = assert_same_checkpoints(stock, lazy)
    if case == "save_only_model":
        assert "optimizer.pt" not in os.listdir(lazy / names[-1])
    if case.startswith("best_model"):
        state = json.loads((lazy / names[-1] / "trainer_state.json").read_text())
        assert state["best_model_checkpoint"].endswith("checkpoint-2"), state["best_model_checkpoint"]
        assert "checkpoint-2" in names
    if case == "buffer_changed_in_forward":
        saved = safetensors_torch.load_file(str(lazy / "checkpoint-4" / "model.safetensors"))["seen"]
        assert saved.tolist() == [4.0] * 4, saved  # the value at the save, not the next forward's
    if case == "sharded":
        files = os.listdir(lazy / names[-1])
        assert "model.safetensors.index.json" in files and sum(".safetensors" in f for f in files) > 2, files


def _staging(out: Path) -> bool:
    """A checkpoint folder is under its staging name (``.checkpoint-N.lazyckpt-<host>-<pid>-<n>.tmp``)."""
    return any(p.name.startswith(".checkpoint-") and p.name.endswith(".tmp") for p in out.iterdir())


def test_the_save_returns_before_the_folder_is_committed_and_the_name_only_ever_holds_it_complete(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    seen: list[tuple[int, bool, bool]] = []

    class Probe(transformers.TrainerCallback):
        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            final = out / f"checkpoint-{state.global_step}"
            staging = list(out.glob(f".checkpoint-{state.global_step}.lazyckpt-*.tmp"))  # this save's own
            seen.append((state.global_step, final.exists(), len(staging) == 1))
            for p in out.glob("checkpoint-*"):  # every visible folder is whole
                assert lazyckpt.transformers.latest(p.parent) is not None
                assert (p / "trainer_state.json").exists() and (p / "optimizer.pt").exists(), p

    tr = tiny.trainer(out, max_steps=6, save_steps=2)
    tr.add_callback(Probe())
    handle = lazyckpt.transformers.install(tr)
    tr.train()
    # on_save runs right after _save_checkpoint returned: the folder is still under its staging name
    # (committed only after the next optimizer step confirmed the copies), except the last, drained
    # by the end of train() (the callback runs before that).
    assert seen == [(2, False, True), (4, False, True), (6, False, True)], seen
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    handle.uninstall()


def test_push_to_hub_pushes_each_folder_after_its_commit_as_stock_does(tmp_path: Path) -> None:
    pushed: dict[str, list[tuple[str, bool]]] = {"stock": [], "lazy": []}

    def recorder(which: str) -> Any:
        def setup(tr: Any) -> None:
            tr.args.push_to_hub = True  # (no hub at test time: the push itself is recorded)

            def push(folder: str) -> None:
                pushed[which].append(
                    (os.path.basename(folder), os.path.exists(os.path.join(folder, "trainer_state.json")))
                )

            tr._push_from_checkpoint = push

        return setup

    out = tmp_path / "out"
    run(out, False, moved_to=tmp_path / "stock", setup=recorder("stock"))
    run(out, True, moved_to=tmp_path / "lazy", setup=recorder("lazy"))
    assert pushed["lazy"] == pushed["stock"] == [("checkpoint-2", True), ("checkpoint-4", True), ("checkpoint-6", True)]


def test_levels_write_checkpoint_folders_by_level_and_latest_finds_the_newest_complete(tmp_path: Path) -> None:
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    stock = tmp_path / "stock"
    run(tmp_path / "out", False, moved_to=stock, save_steps=1, max_steps=4)
    levels = [Level(str(fast), every=1, keep=2), Level(str(slow), every=2)]
    tr = tiny.trainer(tmp_path / "unused", save_steps=1, max_steps=4)
    handle = lazyckpt.transformers.install(tr, levels=levels)
    tr.train()
    handle.uninstall()
    assert sorted(os.listdir(fast)) == ["checkpoint-3", "checkpoint-4"]
    assert sorted(os.listdir(slow)) == ["checkpoint-2", "checkpoint-4"]
    for level in (fast, slow):  # the tensors and stock files of that step (paths inside differ: not compared)
        for f in ("model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"):
            assert_same(load_any(level / "checkpoint-4" / f), load_any(stock / "checkpoint-4" / f), f"{level}/{f}")
    assert lazyckpt.transformers.latest(levels).path == str(fast / "checkpoint-4")
    shutil.rmtree(fast / "checkpoint-4")
    (slow / "checkpoint-4" / "optimizer.pt").write_bytes(b"torn")
    with pytest.warns(lazyckpt.IncompleteCheckpointWarning):
        assert lazyckpt.transformers.latest(levels).path == str(fast / "checkpoint-3")
    assert not list((tmp_path / "unused").glob("*checkpoint-*")), "with levels no checkpoint goes to output_dir"


def test_levels_copy_on_their_own_thread_while_the_fast_level_commits_and_keep_the_source_until_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The slower level's copy of checkpoint-2 is held until the fast level committed checkpoint-4 and applied its
    keep=2 (which drops checkpoint-2 there): the commit thread is not the copy's, and checkpoint-2 stays at the
    fast level, pinned, until its copy has read it. Fails with the copies on the commit thread (checkpoint-4 never
    commits: the copy waits in vain) or without the pin (the copy finds no source)."""
    from lazyckpt.schedule import _copy, _runner

    fast, slow, stock = tmp_path / "fast", tmp_path / "slow", tmp_path / "stock"
    run(tmp_path / "out", False, moved_to=stock, save_steps=1, max_steps=4)
    fast_kept_four = threading.Event()
    retain, copy_tree = _runner.Runner.retain, _copy.copy_tree

    def retain_then_tell(self: Any, index: int, sweep: bool = False) -> None:
        retain(self, index, sweep)
        if index == 0 and not sweep and (fast / "checkpoint-4").is_dir():
            fast_kept_four.set()

    def held_copy(src: str, dst: str, fsync: bool) -> None:
        if src.endswith("checkpoint-2"):
            assert fast_kept_four.wait(60), "checkpoint-4 was not committed while checkpoint-2 was being copied"
            assert os.path.isdir(src), "the fast level dropped checkpoint-2 before its copy read it"
        copy_tree(src, dst, fsync)

    monkeypatch.setattr(_runner.Runner, "retain", retain_then_tell)
    monkeypatch.setattr(_copy, "copy_tree", held_copy)
    levels = [Level(str(fast), every=1, keep=2), Level(str(slow), every=2)]
    tr = tiny.trainer(tmp_path / "unused", save_steps=1, max_steps=4)
    with lazyckpt.transformers.install(tr, levels=levels):
        tr.train()
    assert sorted(os.listdir(fast)) == ["checkpoint-3", "checkpoint-4"]
    assert sorted(os.listdir(slow)) == ["checkpoint-2", "checkpoint-4"]
    for f in ("model.safetensors", "optimizer.pt", "rng_state.pth"):
        assert_same(load_any(slow / "checkpoint-2" / f), load_any(stock / "checkpoint-2" / f), f)


def test_levels_keep_the_best_checkpoint_beside_the_newest(tmp_path: Path) -> None:
    fast = tmp_path / "fast"
    tr = tiny.trainer(
        tmp_path / "unused", eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
        metric_for_best_model="eval_loss", greater_is_better=True, max_steps=8,
    )  # fmt: skip  # "best" is the highest loss: an early checkpoint stays best
    with lazyckpt.transformers.install(tr, levels=[Level(str(fast), every=2, keep=1)]):
        tr.train()
    best = os.path.basename(tr.state.best_model_checkpoint)
    assert best != "checkpoint-8"
    assert sorted(os.listdir(fast)) == sorted([best, "checkpoint-8"])


def test_a_failed_copy_to_a_slower_level_is_raised_once_and_the_fast_level_holds_the_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from lazyckpt.schedule import _copy

    fast, slow = tmp_path / "fast", tmp_path / "slow"

    def full_disk(src: str, dst: str, fsync: bool) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", dst)

    monkeypatch.setattr(_copy, "copy_tree", full_disk)
    tr = tiny.trainer(tmp_path / "unused", save_steps=2, max_steps=2)
    handle = lazyckpt.transformers.install(tr, levels=[Level(str(fast)), Level(str(slow))])
    with pytest.raises(lazyckpt.LevelError) as info:
        tr.train()  # (raised by the wait before stock's end of training)
    assert info.value.errno == errno.ENOSPC and info.value.level == 1
    handle.uninstall()  # raised once: not again
    assert os.listdir(fast) == ["checkpoint-2"] and not os.listdir(slow)


def test_levels_a_save_failing_after_its_files_ends_its_level_copies_and_nothing_waits_for_ever(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """checkpoint-2's fsync of stock's files fails (after it took its place in the slower level's schedule): the
    save raises, nothing is published at either level, and every wait ends (the level thread's copy waits for the
    aborted commit, which ends); the next run saves as usual."""
    from lazyckpt.transformers._folder import CheckpointSave

    fast, slow = tmp_path / "fast", tmp_path / "slow"
    real = CheckpointSave.sync_stock_files

    def fails_at_two(self: Any) -> None:
        if self.step == 2:
            raise OSError(errno.EIO, "Input/output error (injected)")
        real(self)

    monkeypatch.setattr(CheckpointSave, "sync_stock_files", fails_at_two)
    levels = [Level(str(fast), every=1), Level(str(slow), every=2)]
    tr = tiny.trainer(tmp_path / "unused", save_steps=1, max_steps=3)
    handle = lazyckpt.transformers.install(tr, levels=levels)
    with pytest.raises(OSError, match="injected"):
        tr.train()
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (handle.uninstall(), done.set()), daemon=True)
    waiter.start()
    assert done.wait(60), "uninstall() still waiting for the failed save's copy"
    assert sorted(os.listdir(fast)) == ["checkpoint-1"] and not os.listdir(slow)


def test_levels_a_run_resumed_from_an_older_step_drops_the_abandoned_newer_folders(tmp_path: Path) -> None:
    fast, slow = tmp_path / "fast", tmp_path / "slow"
    levels = [Level(str(fast), every=1), Level(str(slow), every=2)]
    tr = tiny.trainer(tmp_path / "unused", save_steps=1, max_steps=4)
    with lazyckpt.transformers.install(tr, levels=levels):
        tr.train()
    tr = tiny.trainer(tmp_path / "unused", save_steps=1, max_steps=3)
    with lazyckpt.transformers.install(tr, levels=levels):
        tr.train(resume_from_checkpoint=str(fast / "checkpoint-2"))
    assert sorted(os.listdir(fast)) == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert sorted(os.listdir(slow)) == ["checkpoint-2"]
    assert lazyckpt.transformers.latest(levels).path == str(fast / "checkpoint-3")


# -- bad input: refused at install, nothing changed -----------------------------------------------


def test_install_twice_is_refused(tmp_path: Path) -> None:
    tr = tiny.trainer(tmp_path)
    handle = lazyckpt.transformers.install(tr)
    with pytest.raises(UnsupportedTrainerError, match="already installed"):
        lazyckpt.transformers.install(tr)
    handle.uninstall()
    assert "_save_checkpoint" not in vars(tr)
    lazyckpt.transformers.install(tr).uninstall()  # after uninstall(), again


def test_a_subclass_overriding_save_checkpoint_is_refused(tmp_path: Path) -> None:
    class Custom(transformers.Trainer):
        def _save_checkpoint(self, model: Any, trial: Any) -> None:
            super()._save_checkpoint(model, trial)

    tr = tiny.trainer(tmp_path, trainer_cls=Custom)
    with pytest.raises(UnsupportedTrainerError, match="overrides _save_checkpoint"):
        lazyckpt.transformers.install(tr)
    assert "_save_checkpoint" not in vars(tr)


def test_a_transformers_whose_save_path_differs_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tr = tiny.trainer(tmp_path)
    stock = transformers.Trainer._save_checkpoint

    def moved(self: Any, model: Any, trial: Any) -> None:  # a release that saves one more file
        stock(self, model, trial)
        self.save_extra_state()

    monkeypatch.setattr(_compat, "_checked", {})
    monkeypatch.setattr(transformers.Trainer, "_save_checkpoint", moved)
    with pytest.raises(UnsupportedTrainerError, match="saves checkpoints differently"):
        lazyckpt.transformers.install(tr)
    assert "_save_checkpoint" not in vars(tr) and torch.save is _compat._AT_IMPORT["torch.save"]
    monkeypatch.setattr(_compat.transformers, "__version__", "4.57.1")
    monkeypatch.setattr(_compat, "_checked", {})
    with pytest.raises(UnsupportedTrainerError, match="major version 4"):
        _compat.check_save_path()


def test_the_gate_is_restored_and_routes_nothing_outside_a_checkpoint(tmp_path: Path) -> None:
    originals = dict(_compat._AT_IMPORT)
    tr = tiny.trainer(tmp_path)
    handle = lazyckpt.transformers.install(tr)
    torch.save({"x": torch.ones(2)}, tmp_path / "optimizer.pt")  # not inside a checkpoint: stock
    assert torch.load(tmp_path / "optimizer.pt")["x"].sum() == 2
    handle.uninstall()
    assert torch.save is originals["torch.save"]
    assert transformers.modeling_utils.safe_save_file is originals["transformers.modeling_utils.safe_save_file"]


def test_a_failed_write_leaves_no_folder_and_is_raised_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from lazyckpt.storage import fs as _fs

    out = tmp_path / "out"
    tr = tiny.trainer(out, max_steps=4, save_steps=2)
    handle = lazyckpt.transformers.install(tr)
    real = _fs.pwrite_all
    calls = {"n": 0}

    def failing(fd: int, data: Any, offset: int) -> None:
        calls["n"] += 1
        raise OSError(28, "No space left on device (injected)")

    monkeypatch.setattr(_fs, "pwrite_all", failing)
    try:
        with pytest.raises(lazyckpt.WriteError) as first:
            tr.train()
        monkeypatch.setattr(_fs, "pwrite_all", real)
        assert calls["n"] > 0
        assert not any(p.name.startswith("checkpoint-") for p in out.iterdir()), os.listdir(out)
        try:
            handle.wait()  # the error train() raised is not raised again
        except lazyckpt.WriteError as exc:  # another file of the failed folder may report its own, once
            assert str(exc) != str(first.value)
            handle.wait()  # and then nothing more
    finally:
        handle.uninstall()


# -- a real process killed mid-save --------------------------------------------------------------


def _kill_rounds(tmp_path: Path, lazy: bool, rounds: int) -> tuple[list[str], int]:
    """Start the child, SIGKILL it at a random moment after its first checkpoint (lazy: once a
    checkpoint is in flight under its staging name), ``rounds`` times; return the problems found
    (partial highest folders) and how many kills hit a save in flight."""
    out = tmp_path / "out"
    problems, mid_save = [], 0
    rng = __import__("random").Random(1)
    for _ in range(rounds):
        proc = subprocess.Popen(
            [sys.executable, str(SCRIPTS / "kill_child.py"), str(out), "1" if lazy else "0"],
            env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 120
        while not (out / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "child did not start"
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 0.5))
        if lazy:  # force the window: kill while a checkpoint is under its staging name, after one committed
            while not (list(out.glob("checkpoint-*")) and _staging(out)):
                assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint in flight"
                time.sleep(0.005)
        mid_save += _staging(out) or bool(lazy is False and list(out.glob("checkpoint-*")))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        last = transformers.trainer_utils.get_last_checkpoint(str(out))
        if last is not None and getattr(lazyckpt.transformers.latest(out), "path", None) != last:
            problems.append(f"{os.path.basename(last)}: {sorted(os.listdir(last))}")
        (out / "started").unlink()
    return problems, mid_save


@pytest.mark.slow(reason="transformers Trainer runs in child processes, each SIGKILLed mid-save, then resumed")
def test_sigkill_mid_save_never_leaves_a_partial_highest_folder(tmp_path: Path) -> None:
    problems, mid_save = _kill_rounds(tmp_path, lazy=True, rounds=4)
    assert not problems, problems
    assert mid_save >= 1, "no kill landed while a checkpoint was being written"
    # stock resume (nothing installed) from what get_last_checkpoint picks
    out = tmp_path / "out"
    last = transformers.trainer_utils.get_last_checkpoint(str(out))
    assert last is not None
    step = int(last.rsplit("-", 1)[1])
    tr = tiny.trainer(tmp_path / "resume", max_steps=step + 1, save_steps=1000)
    tr.train(resume_from_checkpoint=last)
    assert tr.state.global_step == step + 1


# -- DDP: 2 CPU processes under torchrun ----------------------------------------------------------


def _torchrun(out: Path, lazy: bool) -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from _launch import free_port, rank_env

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
        str(SCRIPTS / "ddp_train.py"), str(out), "1" if lazy else "0",
    ]  # fmt: skip
    res = subprocess.run(cmd, env=rank_env(), capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.mark.slow(reason="two DDP Trainer runs (stock and lazy), two gloo processes each")
def test_ddp_two_processes_write_what_stock_writes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    _torchrun(out, lazy=False)
    shutil.move(str(out), str(tmp_path / "stock"))
    _torchrun(out, lazy=True)
    shutil.move(str(out), str(tmp_path / "lazy"))
    names = assert_same_checkpoints(tmp_path / "stock", tmp_path / "lazy")
    assert names == ["checkpoint-4", "checkpoint-6"]
    assert {"rng_state_0.pth", "rng_state_1.pth"} <= set(os.listdir(tmp_path / "lazy" / "checkpoint-6"))
    assert_same(torch.load(tmp_path / "final-lazy.pt"), torch.load(tmp_path / "final-stock.pt"), "final weights")


def test_uninstall_ends_the_install(tmp_path: Path) -> None:
    """The lifecycle vocabulary (docs/ARCHITECTURE.md): ``uninstall()`` ends an install, as on the
    Accelerate handle; there is no other spelling."""
    tr = tiny.trainer(tmp_path / "out", max_steps=1, save_steps=1000)
    handle = lazyckpt.transformers.install(tr)
    assert not hasattr(handle, "remove")
    handle.uninstall()
    assert handle.uninstalled and "_lazyckpt_handle" not in vars(tr)
    handle.uninstall()  # idempotent
