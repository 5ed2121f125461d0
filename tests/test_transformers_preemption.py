"""lazyckpt.transformers under preemption: the Trainer's own JIT checkpoint (``enable_jit_checkpoint``) is
committed at its ``checkpoint-N`` name when it returns, with or without a regular save of the same step
still pending, and a process SIGKILLed that moment resumes with stock; two saves of one name never race.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tests import _launch  # noqa: E402
from tests._util import assert_same  # noqa: E402
from tests.test_transformers import load_any  # noqa: E402
from tests.transformers_scripts import tiny  # noqa: E402

import lazyckpt.transformers  # noqa: E402
from lazyckpt.transformers import _handle  # noqa: E402

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "transformers_scripts" / "jit_child.py"
AT = 3


def _preempted(out: Path, lazy: bool, save_steps: int) -> None:
    """The child trains, is preempted after step AT and SIGKILLed the moment its JIT save returns."""
    done = _launch.run_python([str(SCRIPT), str(out), "1" if lazy else "0", str(AT), str(save_steps)],
                              dict(os.environ), timeout=240)  # fmt: skip
    assert "JIT-RETURNED" in done.stdout, done.stdout + done.stderr
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr[-3000:])


@pytest.mark.parametrize("save_steps", [1, 1000], ids=["regular-save-of-the-step-pending", "jit-save-only"])
def test_the_jit_checkpoint_is_complete_when_it_returns_and_stock_resumes_from_it(tmp_path: Path, save_steps: int):
    stock, lazy = tmp_path / "stock", tmp_path / "lazy"
    _preempted(stock, False, save_steps)
    _preempted(lazy, True, save_steps)
    name = f"checkpoint-{AT}"
    assert transformers.trainer_utils.get_last_checkpoint(str(lazy)) == str(lazy / name)
    files = sorted(p.name for p in (stock / name).iterdir())
    assert "checkpoint-is-incomplete.txt" not in files
    assert sorted(p.name for p in (lazy / name).iterdir()) == files
    for f in files:
        if f.endswith((".safetensors", ".pt", ".pth")):
            assert_same(load_any(lazy / name / f), load_any(stock / name / f), f)
    assert not [p.name for p in lazy.iterdir() if p.name.startswith(".")], "a staging folder was left"
    # stock resume in this process (no lazyckpt), from the folder the killed job left
    tr = tiny.trainer(lazy, max_steps=AT + 2, save_steps=1000, logging_steps=1000)
    tr.train(resume_from_checkpoint=True)
    assert tr.state.global_step == AT + 2


@pytest.mark.parametrize("order", ["in-save-order", "second-commits-first"])
def test_two_saves_of_one_name_the_last_wins_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, order: str):
    """The first save's commit is held until the second save of the same ``checkpoint-N`` has started
    (in-save-order) or has committed (second-commits-first): neither touches the other's staging folder,
    no error, and the name ends holding the second save's state, complete."""
    out = tmp_path / "out"
    tr = tiny.trainer(out, max_steps=2, save_steps=1000, logging_steps=1000)
    handle = lazyckpt.transformers.install(tr)
    tr.train()
    second_started, second_done = threading.Event(), threading.Event()
    stock_commit = _handle.Checkpoints.commit
    first: list[_handle.CheckpointSave] = []

    def held(self: _handle.Checkpoints, job):  # type: ignore[no-untyped-def]
        save = job.__self__
        if save is first[0]:
            gate = second_started if order == "in-save-order" else second_done
            threading.Thread(target=lambda: (gate.wait(60), stock_commit(self, job)), daemon=True).start()
            return
        stock_commit(self, job)

    monkeypatch.setattr(_handle.Checkpoints, "commit", held)
    stock_start = _handle.Checkpoints.start

    def start(self, run_dir, step):  # type: ignore[no-untyped-def]
        save = stock_start(self, run_dir, step)
        if not first:
            first.append(save)
        else:
            second_started.set()
        return save

    monkeypatch.setattr(_handle.Checkpoints, "start", start)
    tr._save_checkpoint(tr.model, trial=None)
    handle.checkpointer.wait_staged()
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(1.0)
    expected = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
    tr._save_checkpoint(tr.model, trial=None)
    second = handle._checkpoints._saves[-1]
    threading.Thread(target=lambda: (second.done.wait(60), second_done.set()), daemon=True).start()
    handle.wait(timeout=60)
    assert first[0].done.is_set() and first[0].error is None and second.error is None
    saved = load_any(out / "checkpoint-2" / "model.safetensors")["tensors"]
    for k, v in saved.items():
        assert torch.equal(v, expected[k]), k
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")], "a staging folder was left"
    handle.uninstall()
