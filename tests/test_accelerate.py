"""lazyckpt.accelerate: lazy accelerator.save_state with the stock layout (single process, CPU).

Every check compares against something independent of lazyckpt: the files stock ``save_state`` writes
for the same setup, a deep copy of the training state taken when ``save_state`` was called (training
keeps stepping right after), and what a stock Accelerator (in a fresh process where it matters) loads.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import threading
from concurrent.futures import Future
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402

HERE = Path(__file__).resolve().parent
import accelerate.checkpointing  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402

import lazyckpt.accelerate as LA  # noqa: E402
from _launch import run_python  # noqa: E402
from _util import hold_staging  # noqa: E402
from accelerate_scripts import acc_common as C  # noqa: E402
from lazyckpt import LazyCheckpointer  # noqa: E402
from lazyckpt.accelerate import _compat as _accelerate_compat  # noqa: E402
from lazyckpt.commit.folder import MARKER_PREFIX  # noqa: E402
from lazyckpt.errors import WriteError  # noqa: E402
from lazyckpt.storage import fs as _fs  # noqa: E402

pytestmark = pytest.mark.integration

STOCK_SAVE = accelerate.checkpointing.save


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH", ""), str(C.SRC), str(C.TESTS)] if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@pytest.fixture
def installs():
    """install() wrapper that always removes what it installed, even when a test fails."""
    made = []

    def _install(acc, **kw):
        h = LA.install(acc, **kw)
        made.append(h)
        return h

    yield _install
    for h in made:
        try:
            h.uninstall()
        except Exception:  # noqa: BLE001 - a test may leave a deliberately failed save behind
            pass
    assert accelerate.checkpointing.save is STOCK_SAVE


def make(
    tmp_path=None,
    *,
    seed=0,
    second_model=False,
    mixed_precision="no",
    grad_accum=1,
    scaler=False,
    project=None,
    model_kw=None,
    custom=0,
):
    acc = Accelerator(
        cpu=True, mixed_precision=mixed_precision, gradient_accumulation_steps=grad_accum, project_config=project
    )
    if scaler:
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)  # as fp16 on GPU; CPU scaler for the test
    objs = list(acc.prepare(*C.build(seed, second_model=second_model, **(model_kw or {}))))
    customs = [C.Counter() for _ in range(custom)]
    if customs:
        acc.register_for_checkpointing(*customs)
    return acc, objs, customs


def split(objs):
    return objs[0::3], objs[1::3], objs[2::3]


def step(acc, objs, gen, vocab=64, **kw):
    model, opt, sched = objs[:3]
    extra = tuple(objs[3:6]) if len(objs) > 3 else None
    return C.train_step(acc, model, opt, sched, gen, vocab=vocab, extra=extra, **kw)


def _run_script(name, *args):
    """Run tests/accelerate_scripts/<name> in a fresh interpreter; its output is in the result."""
    return run_python([str(HERE / "accelerate_scripts" / name), *map(str, args)], _env(), timeout=180)


def stock_restore_subprocess(tmp_path, dirs, **cfg):
    cfg = dict(cfg, dirs=[str(d) for d in dirs])
    cfg.setdefault("model", {})
    cfg_path = tmp_path / "restore.json"
    cfg_path.write_text(json.dumps(cfg))
    out = tmp_path / "restored.pt"
    r = _run_script("stock_restore.py", cfg_path, out)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return torch.load(out, weights_only=False)


def stock_restore_inprocess(
    folder, *, model_kw=None, second_model=False, mixed_precision="no", grad_accum=1, scaler=False, custom=0
):
    """A fresh stock Accelerator (new state, new objects, different init) that loads ``folder``."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, objs, customs = make(
        seed=1234,
        second_model=second_model,
        mixed_precision=mixed_precision,
        grad_accum=grad_accum,
        scaler=scaler,
        model_kw=model_kw,
        custom=custom,
    )
    assert "save_state" not in vars(acc)
    acc.load_state(str(folder))
    models, opts, scheds = split(objs)
    return C.snapshot(acc, models, opts, scheds, customs)


def assert_restored(got, want, *, rng=True):
    for k in ("models", "opts", "scheds", "customs", "step", "scaler"):
        C.assert_same(got[k], want[k], k)
    if rng:
        C.assert_same(got["torch_rng"], want["torch_rng"], "torch_rng")
        C.assert_same(got["np_rng"], want["np_rng"], "np_rng")
        assert got["py_rng"] == want["py_rng"]


def load_any(path: Path):
    if path.suffix == ".safetensors":
        with safe_open(str(path), "pt") as f:
            # lazyckpt may add its own "lazyckpt_*" metadata (e.g. a CRC); everything else must match stock
            meta = {k: v for k, v in (f.metadata() or {}).items() if not k.startswith("lazyckpt_")}
            return {"__metadata__": meta, **{k: f.get_tensor(k) for k in f.keys()}}  # noqa: SIM118
    return torch.load(path, weights_only=False)


# ------------------------------------------------------------------------------------------------
# A checkpointer double with the core's contract whose writes happen only when someone waits for them
# (or on release()), so orchestration races are deterministic instead of timing dependent.
# ------------------------------------------------------------------------------------------------


class _GatedHandle:
    def __init__(self, owner, path, data):
        self._owner, self.path, self._data = owner, path, data
        self._done = threading.Event()
        self._exc = None
        self._seen = False  # its error reached someone (the core's "reported once")
        self._cbs = []
        self._lock = threading.Lock()

    def wait(self, timeout=None):
        self._owner._write_through(self)
        if self._exc is not None:
            self._seen = True
            raise self._exc
        return None

    def wait_staged(self, timeout=None):
        return None

    def done(self):
        return self._done.is_set()

    def exception(self, timeout=0):
        if timeout != 0:
            self._owner._write_through(self)
        return self._exc

    def add_done_callback(self, fn):
        with self._lock:
            if not self._done.is_set():
                self._cbs.append(fn)
                return
        fn(self)

    def _finish(self, exc):
        with self._lock:
            self._exc = exc
            self._done.set()
            cbs, self._cbs = self._cbs, []
        for cb in cbs:
            cb(self)


class GatedCheckpointer:
    def __init__(self, fail=()):
        self.queue: list[_GatedHandle] = []
        self.tracked = []
        self.fail = set(fail)
        self.closed = False
        self.lock = threading.RLock()
        self.unseen: list = []  # (handle or None, error): the core's error ledger

    def save(self, obj, path, format="torch", metadata=None, before_commit=None):
        if format == "safetensors":
            from safetensors.torch import save as st_save

            data = st_save(obj, metadata=metadata)
        else:
            buf = io.BytesIO()
            torch.save(obj, buf)
            data = buf.getvalue()
        h = _GatedHandle(self, os.path.abspath(os.fspath(path)), data)
        h._before_commit = before_commit
        with self.lock:
            self.queue.append(h)
        return h

    def _write_through(self, target):
        with self.lock:
            if target._done.is_set():
                return
            idx = self.queue.index(target)
            todo, self.queue = self.queue[: idx + 1], self.queue[idx + 1 :]
        for h in todo:  # FIFO, like the core's committer
            exc = None
            if os.path.basename(h.path) in self.fail:
                exc = WriteError(f"injected failure writing {h.path}", path=h.path)
                with self.lock:  # published before the handle is done, as the core does
                    self.unseen.append((h, exc))
            else:
                tmp = h.path + ".gated-tmp"
                with open(tmp, "wb") as f:
                    f.write(h._data)
                    f.flush()
                    os.fsync(f.fileno())
                if h._before_commit is not None:
                    h._before_commit()
                os.replace(tmp, h.path)
            h._finish(exc)

    def release(self):
        with self.lock:
            last = self.queue[-1] if self.queue else None
        if last is not None:
            self._write_through(last)

    def pending_paths(self):
        with self.lock:
            return {h.path for h in self.queue}

    def add_error(self, exc):
        with self.lock:
            self.unseen.append((None, exc))

    def raise_errors(self):
        with self.lock:
            items, self.unseen = self.unseen, []
        errors = [e for h, e in items if h is None or not h._seen]
        for h, _ in items:
            if h is not None:
                h._seen = True
        if errors:
            raise errors[0]

    def wait(self, timeout=None):
        self.release()
        self.raise_errors()

    def track(self, *opts):
        self.tracked.extend(opts)

    def remove(self, path, trash_dir=None):
        with self.lock:  # the integration drains a folder before deleting it
            assert not any(h.path.startswith(os.path.abspath(path) + os.sep) for h in self.queue), path
        shutil.rmtree(path)
        done = Future()
        done.set_result(None)
        return done

    def close(self):
        self.release()
        self.closed = True


# ------------------------------------------------------------------------------------------------
# Layout: the same files, with the same names and contents, as stock save_state
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "safe, scaler, save_on_each_node",
    [(True, False, False), (False, True, False), (True, True, True)],
    ids=["safetensors", "torch+scaler", "safetensors+scaler+each-node"],
)
def test_same_files_and_contents_as_stock(tmp_path, installs, safe, scaler, save_on_each_node):
    proj = ProjectConfiguration(project_dir=str(tmp_path), save_on_each_node=save_on_each_node)
    acc, objs, customs = make(second_model=True, scaler=scaler, project=proj, custom=2)
    gen = torch.Generator().manual_seed(0)
    step(acc, objs, gen)
    for c in customs:
        c.bump()
    acc.save_state(str(tmp_path / "stock"), safe_serialization=safe)  # stock, before install
    h = installs(acc)
    acc.save_state(str(tmp_path / "lazy"), safe_serialization=safe)
    h.wait()

    stock_files = C.file_tree(tmp_path / "stock")
    assert C.file_tree(tmp_path / "lazy") == stock_files
    expected = {
        "random_states_0.pkl",
        "optimizer.bin",
        "optimizer_1.bin",
        "scheduler.bin",
        "scheduler_1.bin",
        "custom_checkpoint_0.pkl",
        "custom_checkpoint_1.pkl",
    }
    expected |= {"model.safetensors", "model_1.safetensors"} if safe else {"pytorch_model.bin", "pytorch_model_1.bin"}
    if scaler:
        expected.add("scaler.pt")
    assert set(stock_files) == expected
    for name in stock_files:
        C.assert_same(load_any(tmp_path / "lazy" / name), load_any(tmp_path / "stock" / name), name)
    if safe:  # tied weights: stock keeps one of the two keys; lazyckpt drops the same one
        with safe_open(str(tmp_path / "lazy" / "model.safetensors"), "pt") as f:
            keys = set(f.keys())
            assert f.metadata()["format"] == "pt"
        assert ("emb.weight" in keys) != ("head.weight" in keys)


# ------------------------------------------------------------------------------------------------
# What a stock Accelerator restores is the state at the moment save_state was called
# ------------------------------------------------------------------------------------------------


def test_stock_restore_in_fresh_process_while_training_steps_right_after(tmp_path, installs):
    """~75 MB per save and a 1 MiB host budget: the copies are still running when the next step comes.

    (With the guard's wait disabled this test fails: the step changes tensors mid-copy.)
    """
    model_kw = dict(vocab=8192, dim=512, hidden=2048)
    acc, objs, customs = make(second_model=True, model_kw=model_kw, custom=1)
    h = installs(acc, host_memory_budget=1 << 20, chunk_bytes=256 << 10)
    gen = torch.Generator().manual_seed(0)
    snaps, dirs = [], []
    for i in range(3):
        step(acc, objs, gen, vocab=8192)
        customs[0].bump()
        d = tmp_path / f"ckpt{i}"
        snaps.append(C.snapshot(acc, *split(objs), customs))  # the state at the moment save_state is called
        acc.save_state(str(d))
        dirs.append(d)
        customs[0].bump()  # in-place change of a registered object's tensor right after saving
        step(acc, objs, gen, vocab=8192)  # the optimizer changes params/state right after saving
    h.wait()
    got = stock_restore_subprocess(tmp_path, dirs, model=model_kw, second_model=True, custom=1)
    for g, want in zip(got, snaps, strict=True):
        assert_restored(g, want)
    # and the states really differ between saves (the comparison above can fail)
    with pytest.raises(AssertionError):
        C.assert_same(got[0]["models"], got[1]["models"])


@pytest.mark.parametrize(
    "mixed_precision, grad_accum, scaler",
    [("bf16", 2, False), ("no", 1, True)],
    ids=["bf16+grad-accum-2", "grad-scaler"],
)
def test_mixed_precision_and_gradient_accumulation(tmp_path, installs, mixed_precision, grad_accum, scaler):
    acc, objs, _ = make(mixed_precision=mixed_precision, grad_accum=grad_accum, scaler=scaler)
    h = installs(acc)
    gen = torch.Generator().manual_seed(0)
    snaps = []
    for i in range(4):  # with accumulation 2, saves land both between micro-steps and after real steps
        step(acc, objs, gen, accumulate=grad_accum > 1, inf=(scaler and i == 1))  # inf: the scaler skips a step
        d = tmp_path / f"c{i}"
        snaps.append((d, C.snapshot(acc, *split(objs))))
        acc.save_state(str(d))
        step(acc, objs, gen, accumulate=grad_accum > 1)
    h.wait()
    if scaler:
        assert snaps[1][1]["scaler"]["scale"] < snaps[0][1]["scaler"]["scale"]  # the inf step was skipped
    for d, want in snaps:
        got = stock_restore_inprocess(d, mixed_precision=mixed_precision, grad_accum=grad_accum, scaler=scaler)
        assert_restored(got, want)


# ------------------------------------------------------------------------------------------------
# Automatic naming + total_limit: same kept folders as stock, deletion never races a pending write
# ------------------------------------------------------------------------------------------------


def _run_auto(tmp_path, name, n_saves, total_limit, install=None):
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    proj = ProjectConfiguration(
        project_dir=str(tmp_path / name), automatic_checkpoint_naming=True, total_limit=total_limit
    )
    acc, objs, _ = make(project=proj)
    h = install(acc) if install else None
    gen = torch.Generator().manual_seed(0)
    snaps = {}
    for i in range(n_saves):
        step(acc, objs, gen)
        snaps[f"checkpoint_{i}"] = C.snapshot(acc, *split(objs))
        acc.save_state()
    if h is not None:
        h.wait()
    base = tmp_path / name / "checkpoints"
    return acc, h, base, snaps


@pytest.mark.parametrize("total_limit", [1, 2])
def test_total_limit_deletion_waits_for_pending_writes(tmp_path, installs, monkeypatch, total_limit):
    gated = GatedCheckpointer()
    seen = []
    real_rmtree = shutil.rmtree

    def spy_rmtree(path, *a, **kw):
        path = os.path.realpath(path)
        seen.append(
            (
                os.path.basename(path),
                sorted(p for p in gated.pending_paths() if p.startswith(path + os.sep)),
                LA.pending_markers(path),
            )
        )
        return real_rmtree(path, *a, **kw)

    monkeypatch.setattr(shutil, "rmtree", spy_rmtree)
    _, _, base_lazy, _ = _run_auto(tmp_path, "lazy", 5, total_limit, install=lambda a: installs(a, checkpointer=gated))
    monkeypatch.setattr(shutil, "rmtree", real_rmtree)
    _, _, base_stock, _ = _run_auto(tmp_path, "stock", 5, total_limit)

    assert [s[0] for s in seen] == [f"checkpoint_{i}" for i in range(5 - total_limit)]
    for name, pending, markers in seen:
        assert pending == [] and markers == [], f"{name} deleted with pending writes {pending} / markers {markers}"
    assert sorted(os.listdir(base_lazy)) == sorted(os.listdir(base_stock))
    for d in os.listdir(base_stock):
        assert C.file_tree(base_lazy / d) == C.file_tree(base_stock / d)


def test_total_limit_with_real_core_and_stock_load(tmp_path, installs):
    _, _, base_lazy, snaps = _run_auto(tmp_path, "lazy", 4, 2, install=installs)
    _, _, base_stock, _ = _run_auto(tmp_path, "stock", 4, 2)
    kept = sorted(os.listdir(base_stock))
    assert kept == ["checkpoint_2", "checkpoint_3"]
    assert sorted(os.listdir(base_lazy)) == kept
    for d in kept:
        assert C.file_tree(base_lazy / d) == C.file_tree(base_stock / d)
        assert_restored(stock_restore_inprocess(base_lazy / d), snaps[d])


def test_save_state_outside_training_returns_durable_with_old_folders_gone(tmp_path, installs, monkeypatch):
    """Accelerate's own test_with_save_limit / test_checkpoint_deletion: save_state calls with no
    optimizer step between them (no training to overlap with), then the folder is listed (only
    ``checkpoints/``, as stock) or deleted (``TemporaryDirectory``: our writers must be done). The
    background delete of the old folder is slowed so that, without the rule, the hidden trash is
    provably still in project_dir when save_state returns."""
    from lazyckpt.core import removal

    real_delete = removal._delete
    listed = threading.Event()  # set once the test has listed the folders

    def held_delete(path):
        # Without the rule, save_state returns first and the listing sees the trash; with it,
        # save_state waits for this delete, which goes on after the bound (nothing sets `listed` then).
        listed.wait(2)
        real_delete(path)

    monkeypatch.setattr(removal, "_delete", held_delete)
    project = ProjectConfiguration(project_dir=str(tmp_path / "p"), automatic_checkpoint_naming=True, total_limit=1)
    acc, objs, _ = make(project=project)
    installs(acc)
    acc.save_state()
    acc.save_state()
    entries = os.listdir(tmp_path / "p")
    listed.set()
    assert entries == ["checkpoints"]
    assert os.listdir(tmp_path / "p" / "checkpoints") == ["checkpoint_1"]
    assert LA.is_complete(tmp_path / "p" / "checkpoints" / "checkpoint_1")
    shutil.rmtree(tmp_path / "p")  # nothing of lazyckpt's writes there any more


# ------------------------------------------------------------------------------------------------
# load_state waits; incomplete folders are refused (or skipped with automatic naming)
# ------------------------------------------------------------------------------------------------


def test_load_state_waits_for_pending_saves(tmp_path, installs):
    gated = GatedCheckpointer()
    acc, objs, _ = make()
    installs(acc, checkpointer=gated)
    gen = torch.Generator().manual_seed(0)
    step(acc, objs, gen)
    want = C.snapshot(acc, *split(objs))
    acc.save_state(str(tmp_path / "c"))
    assert not (tmp_path / "c" / "model.safetensors").exists()  # nothing written yet: the gate is shut
    assert LA.pending_markers(tmp_path / "c")
    for _ in range(2):
        step(acc, objs, gen)
    acc.load_state(str(tmp_path / "c"))  # must wait (here: make the writes happen) before reading
    assert_restored(C.snapshot(acc, *split(objs)), want)
    assert LA.is_complete(tmp_path / "c")


def test_script_ending_without_wait_leaves_a_complete_folder(tmp_path):
    """No wait(), no remove(): the handle is drained at exit (core.exit, integrations first), so the
    folder's end (held in the script until the interpreter exits) still removes its marker."""
    out, expected = tmp_path / "out", tmp_path / "expected.pt"
    r = _run_script("exit_without_wait.py", out, expected)
    assert r.returncode == 0 and "failed" not in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert LA.is_complete(out), os.listdir(out)
    got = stock_restore_inprocess(out)
    assert_restored(got, torch.load(expected, weights_only=False))


def test_load_state_after_crash_refuses_or_falls_back(tmp_path, installs):
    project, expected = tmp_path / "proj", tmp_path / "expected.pt"
    r = _run_script("crash_after_save.py", project, expected)
    assert r.returncode == -signal.SIGKILL, r.stdout[-3000:] + r.stderr[-3000:]
    base = project / "checkpoints"
    assert sorted(os.listdir(base)) == ["checkpoint_0", "checkpoint_1"]
    assert LA.is_complete(base / "checkpoint_0")
    assert not LA.is_complete(base / "checkpoint_1")
    want = torch.load(expected, weights_only=False)

    model_kw = dict(vocab=4096, dim=1024, hidden=1024)
    acc, objs, _ = make(
        seed=99,
        model_kw=model_kw,
        project=ProjectConfiguration(project_dir=str(project), automatic_checkpoint_naming=True),
    )
    installs(acc)
    with pytest.raises(LA.IncompleteCheckpointError, match="incomplete"):
        acc.load_state(str(base / "checkpoint_1"))
    with pytest.warns(LA.IncompleteCheckpointWarning, match="checkpoint_0"):
        acc.load_state()
    got = C.snapshot(acc, *split(objs))
    assert_restored(got, want)


def test_failed_write_is_reported_and_folder_stays_incomplete(tmp_path, installs):
    gated = GatedCheckpointer(fail={"optimizer.bin"})
    acc, objs, _ = make()
    h = installs(acc, checkpointer=gated)
    gen = torch.Generator().manual_seed(0)
    step(acc, objs, gen)
    acc.save_state(str(tmp_path / "bad"))
    with pytest.raises(WriteError, match="optimizer.bin"):
        h.wait()
    h.wait()  # reported once
    assert not LA.is_complete(tmp_path / "bad")
    with pytest.raises(LA.IncompleteCheckpointError):
        acc.load_state(str(tmp_path / "bad"))

    # an unreported failure surfaces at the next save_state at the latest
    acc.save_state(str(tmp_path / "bad2"))
    gated.release()
    with pytest.raises(WriteError):
        acc.save_state(str(tmp_path / "next"))
    assert not (tmp_path / "next").exists()


# ------------------------------------------------------------------------------------------------
# Hooks and custom objects keep working; remove() restores everything
# ------------------------------------------------------------------------------------------------


def test_user_hooks_and_custom_objects(tmp_path, installs):
    calls = []

    def save_hook(models, weights, output_dir):
        calls.append(("save", os.path.basename(output_dir), len(weights)))
        torch.save(weights.pop(1), os.path.join(output_dir, "second_model.pt"))  # take over model 1

    def load_hook(models, input_dir):
        calls.append(("load", os.path.basename(input_dir), len(models)))
        models.pop(1).load_state_dict(torch.load(os.path.join(input_dir, "second_model.pt")))

    def setup(seed):
        acc, objs, customs = make(seed=seed, second_model=True, custom=1)
        acc.register_save_state_pre_hook(save_hook)
        acc.register_load_state_pre_hook(load_hook)
        return acc, objs, customs

    acc, objs, customs = setup(0)
    gen = torch.Generator().manual_seed(0)
    step(acc, objs, gen)
    acc.save_state(str(tmp_path / "stock"))
    installs(acc)
    customs[0].bump()
    want = C.snapshot(acc, *split(objs), customs)
    acc.save_state(str(tmp_path / "lazy"))
    customs[0].bump()
    step(acc, objs, gen)
    acc.load_state(str(tmp_path / "lazy"))  # through lazyckpt's load_state: waits, then stock loading
    assert_restored(C.snapshot(acc, *split(objs), customs), want)
    assert C.file_tree(tmp_path / "lazy") == C.file_tree(tmp_path / "stock")
    assert "second_model.pt" in C.file_tree(tmp_path / "lazy")
    assert calls == [("save", "stock", 2), ("save", "lazy", 2), ("load", "lazy", 2)]

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc2, objs2, customs2 = setup(77)  # stock accelerator, stock load, same hooks
    acc2.load_state(str(tmp_path / "lazy"))
    assert_restored(C.snapshot(acc2, *split(objs2), customs2), want)


def test_uninstall_restores_stock_behaviour(tmp_path, installs):
    acc, objs, _ = make()
    user_hook = acc.register_save_state_pre_hook(lambda m, w, d: None)
    hooks_before = list(acc._save_model_state_pre_hook)
    class_save = type(acc).save_state
    gated = GatedCheckpointer()
    h = installs(acc, checkpointer=gated)
    assert accelerate.checkpointing.save is not STOCK_SAVE
    assert list(acc._save_model_state_pre_hook)[1:] == hooks_before  # ours first, the user's kept in order
    with pytest.raises(RuntimeError, match="already installed"):
        LA.install(acc)
    gen = torch.Generator().manual_seed(0)
    step(acc, objs, gen)
    acc.save_state(str(tmp_path / "a"))
    assert gated.pending_paths()
    h.uninstall()  # drains first
    assert not gated.pending_paths() and LA.is_complete(tmp_path / "a")
    assert "save_state" not in vars(acc) and "load_state" not in vars(acc)
    assert acc.save_state.__func__ is class_save
    assert accelerate.checkpointing.save is STOCK_SAVE
    assert list(acc._save_model_state_pre_hook) == hooks_before
    assert not gated.closed  # a checkpointer passed in belongs to the caller
    h.uninstall()  # idempotent
    acc.save_state(str(tmp_path / "b"))  # stock again: synchronous, nothing pending, no marker
    assert not gated.pending_paths()
    assert C.file_tree(tmp_path / "b") == C.file_tree(tmp_path / "a")
    user_hook.remove()
    h2 = installs(acc)  # can be installed again
    acc.save_state(str(tmp_path / "c"))
    h2.wait()
    assert C.file_tree(tmp_path / "c") == C.file_tree(tmp_path / "a")


def test_tracks_the_prepared_torch_optimizers(installs):
    gated = GatedCheckpointer()
    acc, objs, _ = make(second_model=True)
    installs(acc, checkpointer=gated)
    assert gated.tracked == []  # tracked lazily, at the first save_state (optimizers may be prepared later)
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        acc.save_state(d)
        gated.release()
    inner = [o.optimizer for o in acc._optimizers]
    assert [id(o) for o in gated.tracked] == [id(o) for o in inner]
    assert all(isinstance(o, torch.optim.Optimizer) for o in gated.tracked)


def test_unsupported_distributed_types_keep_stock_save_state(tmp_path, installs, monkeypatch, caplog):
    gated = GatedCheckpointer()
    acc, objs, _ = make()
    installs(acc, checkpointer=gated)
    # pretend this setup is one lazyckpt leaves alone (FSDP, DeepSpeed, Megatron-LM, XLA)
    monkeypatch.setattr(_accelerate_compat, "STOCK_ONLY_TYPES", frozenset({acc.distributed_type}))
    step(acc, objs, torch.Generator().manual_seed(0))
    with caplog.at_level("WARNING", logger="lazyckpt.accelerate"):
        acc.save_state(str(tmp_path / "a"))
    assert "not supported" in caplog.text
    assert gated.queue == [] and LA.is_complete(tmp_path / "a")  # written synchronously by stock
    assert "model.safetensors" in os.listdir(tmp_path / "a")


def test_install_arguments(installs):
    acc, _, _ = make()
    with pytest.raises(TypeError):
        LA.install(acc, checkpointer=GatedCheckpointer(), host_memory_budget=1 << 20)
    assert "save_state" not in vars(acc)
    h = installs(acc, host_memory_budget=64 << 20, writer_threads=2, load_timeout=5)
    assert isinstance(h.checkpointer, LazyCheckpointer) and h.load_timeout == 5
    h.uninstall()
    assert h.checkpointer.closed  # created by install(): closed by uninstall()


def test_uninstall_drains_then_restores(tmp_path, installs):
    """``uninstall()`` waits for pending saves, restores stock ``save_state`` and closes the checkpointer."""
    acc, objs, _ = make()
    h = installs(acc, host_memory_budget=64 << 20)
    step(acc, objs, torch.Generator().manual_seed(0))
    acc.save_state(str(tmp_path / "a"))
    assert h.uninstalled is False and not hasattr(h, "remove")
    h.uninstall()
    assert h.uninstalled and LA.is_complete(tmp_path / "a")
    assert "save_state" not in vars(acc) and h.checkpointer.closed


def test_marker_that_cannot_be_made_durable_fails_the_save(tmp_path, installs, monkeypatch):
    """The marker is fsynced in the background; the lazy files wait for it before their rename, so if
    it cannot be made durable no file of that save appears and the error reaches wait()."""
    acc, objs, _ = make()
    h = installs(acc)
    real = _fs.fsync_file

    def failing(path):
        if os.path.basename(path).startswith(MARKER_PREFIX):
            raise OSError(5, "injected EIO on the marker")
        return real(path)

    monkeypatch.setattr(_fs, "fsync_file", failing)
    out = tmp_path / "ck"
    acc.save_state(str(out))
    with pytest.raises(WriteError, match="injected EIO"):
        h.wait()
    names = os.listdir(out)
    assert LA.pending_markers(out), "the folder stays marked incomplete"
    assert not any(n.endswith((".safetensors", ".bin")) for n in names), names


def test_install_takes_checkpointer_options(tmp_path, installs):
    """One CheckpointerOptions passed through to the checkpointer install() creates (keywords override it)."""
    from lazyckpt import CheckpointerOptions

    acc, objs, _ = make()
    opts = CheckpointerOptions(host_memory_budget=1 << 20, chunk_bytes=256 << 10, writer_threads=2)
    h = installs(acc, options=opts, fsync=False)
    assert h.checkpointer.options == CheckpointerOptions(
        host_memory_budget=1 << 20, chunk_bytes=256 << 10, writer_threads=2, fsync=False
    )
    acc.save_state(str(tmp_path / "a"))
    h.wait()
    assert LA.is_complete(tmp_path / "a")
    with pytest.raises(TypeError, match="not both"):
        LA.install(acc, checkpointer=h.checkpointer, options=opts)


# ------------------------------------------------------------------------------------------------
# Pickling an installed accelerator; in-place state changes right after a save (issue 20, defects 4, 5)
# ------------------------------------------------------------------------------------------------


@pytest.fixture
def held_staging(monkeypatch):
    """Hold every save's staging until something waits for a save (the guard, a handle, the
    checkpointer): the copies are provably still pending right after save_state. Returns the gate."""
    return hold_staging(monkeypatch)


def _other_state(seed=5):
    """A trained model/optimizer/scheduler of the same shapes, not prepared (what a user loads from)."""
    model, opt, sched = C.build(seed)
    idx, tgt = C.batch(torch.Generator().manual_seed(seed))
    torch.nn.functional.cross_entropy(model(idx), tgt).backward()
    opt.step()
    sched.step()
    return {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict()}


@pytest.mark.parametrize("what", ["model", "optimizer", "scheduler"])
def test_load_state_dict_right_after_save_state_then_load_state_restores(tmp_path, installs, held_staging, what):
    other = _other_state()[what]  # first: its optimizer step would wait for the pending copies below
    acc, objs, _ = make()
    h = installs(acc)
    gen = torch.Generator().manual_seed(0)
    step(acc, objs, gen)
    want = C.snapshot(acc, *split(objs))
    acc.save_state(str(tmp_path / "c"))
    assert not held_staging.is_set(), "the copies must still be pending here"
    target = {"model": acc.unwrap_model(objs[0]), "optimizer": objs[1], "scheduler": objs[2]}[what]
    target.load_state_dict(other)  # stock code: overwrites the saved state at once
    C.assert_same(target.state_dict(), other, what)
    acc.load_state(str(tmp_path / "c"))
    assert_restored(C.snapshot(acc, *split(objs)), want)
    h.wait()
    assert LA.is_complete(tmp_path / "c")


def test_in_place_change_right_after_save_state_is_named_where_the_save_surfaces(tmp_path, installs, held_staging):
    """A change the rule does not cover (p.mul_() under no_grad) fails the save; load_state on that
    folder names that cause (not a killed process), and so does the handle."""
    from lazyckpt.errors import StaleTensorError

    acc, objs, _ = make()
    h = installs(acc)
    step(acc, objs, torch.Generator().manual_seed(0))
    acc.save_state(str(tmp_path / "c"))
    with torch.no_grad():
        acc.unwrap_model(objs[0]).fc.weight.mul_(2)
    held_staging.set()
    with pytest.raises(LA.IncompleteCheckpointError, match=r"(?s)StaleTensorError.*'fc\.weight' was modified in place"):
        acc.load_state(str(tmp_path / "c"))
    try:
        acc.load_state(str(tmp_path / "c"))
    except LA.IncompleteCheckpointError as exc:
        assert "killed" not in str(exc) and isinstance(exc.__cause__, StaleTensorError)
    with pytest.raises(StaleTensorError, match=r"'fc\.weight'") as info:
        h.wait()
    assert info.value.tensor_name == "fc.weight"
    assert not LA.is_complete(tmp_path / "c")


def test_automatic_naming_fallback_names_the_failed_save(tmp_path, installs, held_staging):
    from lazyckpt.errors import StaleTensorError

    acc, objs, _ = make(project=ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True))
    h = installs(acc)
    gen = torch.Generator().manual_seed(0)
    step(acc, objs, gen)
    want = C.snapshot(acc, *split(objs))
    acc.save_state()
    held_staging.set()
    h.wait()
    held_staging.clear()
    step(acc, objs, gen)
    acc.save_state()  # checkpoint_1: changed in place while its copies are pending
    with torch.no_grad():
        acc.unwrap_model(objs[0]).out.bias.add_(1)
    held_staging.set()
    with pytest.warns(LA.IncompleteCheckpointWarning, match=r"(?s)checkpoint_1.*StaleTensorError.*'out\.bias'"):
        acc.load_state()
    assert_restored(C.snapshot(acc, *split(objs)), want)
    with pytest.raises(StaleTensorError):
        h.wait()


def test_installed_accelerator_pickles_as_a_stock_one(tmp_path, installs):
    """Accelerate's own test_can_pickle_dataloader pickles a prepared accelerator; installed, the
    copy is a plain stock Accelerator (no handle, no pending saves) and the original stays lazy."""
    import pickle

    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1)
    dl = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.arange(10.0)), batch_size=2)
    model, opt, sched, dl = acc.prepare(model, opt, sched, dl)
    h = installs(acc)
    acc.backward(model(torch.randn(4, 8)).pow(2).mean())
    opt.step()
    acc.save_state(str(tmp_path / "a"))  # the handle now has threads, a checkpointer, a save in flight
    blob = pickle.dumps(acc)
    h.wait()
    clone = pickle.loads(blob)
    assert clone.save_state.__func__ is Accelerator.save_state
    assert clone.load_state.__func__ is Accelerator.load_state
    assert [b[0].tolist() for b in clone._dataloaders[0]] == [b[0].tolist() for b in dl]
    clone.save_state(str(tmp_path / "b"))  # stock: synchronous, no marker
    assert C.file_tree(tmp_path / "b") == C.file_tree(tmp_path / "a") and LA.is_complete(tmp_path / "b")
    assert isinstance(vars(acc)["save_state"], _accelerate_compat.InstalledMethod)  # the original: still lazy
    acc.save_state(str(tmp_path / "c"))
    h.wait()
    assert C.file_tree(tmp_path / "c") == C.file_tree(tmp_path / "a")


def test_two_save_states_of_one_folder_both_pending_the_second_wins_whole(tmp_path, installs, monkeypatch):
    """The first save_state's files are held at their commit until the second save_state of the same folder
    has returned (both pending at once): no error, no temporary left, the folder complete and holding the
    second save's state (stock's result: the last write wins)."""
    real, go = _fs.commit, threading.Event()

    def held(tmp, final, fsync):
        if threading.current_thread().name.startswith("lazyckpt-committer"):
            go.wait(60)
        real(tmp, final, fsync)

    monkeypatch.setattr(_fs, "commit", held)
    acc, objs, _ = make()
    handle = installs(acc)
    gen = torch.Generator().manual_seed(0)
    folder = tmp_path / "c"
    step(acc, objs, gen)
    acc.save_state(str(folder))
    step(acc, objs, gen)
    acc.save_state(str(folder))
    expected = {k: v.detach().clone() for k, v in acc.unwrap_model(objs[0]).state_dict().items()}
    assert handle.pending() == 2
    go.set()
    handle.wait(timeout=60)
    names = sorted(p.name for p in folder.iterdir())
    assert not [n for n in names if n.startswith(".")], names  # no marker, no temporary
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for k in f.keys():  # noqa: SIM118 - a safetensors handle, not a dict
            assert torch.equal(f.get_tensor(k), expected[k]), k
