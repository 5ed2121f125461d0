"""Retention of folder levels while saves overlap (``MultiLevel(..., folder=True)``, Accelerate's
``save_state`` folders by level). A lazy save returns before its folder is complete, so the next
step's folder can exist, and even be complete, while an older one is still being written. Each
test holds one folder's end (its pending marker stays) and lets retention run:

- a folder still being written is never removed, even once a newer step is complete beside it
  (the save pins its own step until it is done);
- a folder still being written does not count among the ``keep`` newest: the level keeps its newest
  complete folder until the newer one is complete.
"""

from __future__ import annotations

import os

import pytest
import torch

import lazyckpt
from lazyckpt import LazyCheckpointer, Level
from lazyckpt.commit.folder import FolderSave
from lazyckpt.core.handle import Completion, SaveStats
from lazyckpt.errors import IncompleteCheckpointWarning
from lazyckpt.schedule._multi import MultiLevel


class Folders:
    """``produce(path)`` for ``MultiLevel.save_with``: a folder with a pending marker and one file,
    whose end the test chooses (``end(step)``); ``held`` lists the steps not ended at once."""

    def __init__(self, held: set[int]) -> None:
        self.held = held
        self.open: dict[int, tuple[FolderSave, Completion]] = {}

    def produce(self, path: str):
        step = int(os.path.basename(path).rsplit("step-", 1)[1])
        fsave = FolderSave(path)
        torch.save({"step": step, "w": torch.full((8,), float(step))}, os.path.join(path, "model.bin"))
        torch.save({"step": step}, os.path.join(path, "random_states_0.pkl"))  # as Accelerate names them
        completion = Completion(path)
        self.open[step] = (fsave, completion)
        if step not in self.held:
            self.end(step)
        return completion.handle

    def end(self, step: int) -> None:
        fsave, completion = self.open.pop(step)
        error = None
        try:
            fsave.end()  # fails when the folder was removed under the save
        except Exception as exc:  # noqa: BLE001 - the handle carries it
            error = exc
        completion.finish(SaveStats(fsave.folder, 0, 0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0), error)


def _steps(level: str) -> list[str]:
    return sorted(n for n in os.listdir(level) if n.startswith("step-"))


def test_a_folder_being_written_is_not_removed_when_a_newer_step_completes_first(mem):
    folders = Folders(held={3})
    with LazyCheckpointer() as ck:
        ml = MultiLevel(ck, (Level(mem, every=1, keep=1),), ck.options, folder=True)
        h3 = ml.save_with(3, folders.produce)  # step 3's folder: marker, its end held
        ml.save_with(4, folders.produce).wait()  # step 4 complete: keep=1 retention ran after it
        assert _steps(mem) == ["step-00000003", "step-00000004"]  # 3 is still being written: kept
        folders.end(3)
        h3.wait()  # its end found its folder
        ml.drain()
        ml.close()
    assert _steps(mem) == ["step-00000004"]  # then 3 was older than the kept 4
    assert torch.load(os.path.join(mem, "step-00000004", "model.bin"))["step"] == 4


def test_a_newer_folder_being_written_does_not_count_among_the_kept(mem):
    folders = Folders(held={3, 4})
    with LazyCheckpointer() as ck:
        ml = MultiLevel(ck, (Level(mem, every=1, keep=1),), ck.options, folder=True)
        h3 = ml.save_with(3, folders.produce)
        h4 = ml.save_with(4, folders.produce)  # saved before step 3's folder is complete (a lazy save)
        folders.end(3)
        h3.wait()  # step 3 complete: retention ran with step 4's folder still pending beside it
        assert _steps(mem) == ["step-00000003", "step-00000004"]  # the only complete folder stays
        with pytest.warns(IncompleteCheckpointWarning, match="step-00000004"):
            found = lazyckpt.latest([mem])
        assert found is not None and (found.step, found.level) == (3, 0)
        folders.end(4)
        h4.wait()
        ml.drain()
        ml.close()
    assert _steps(mem) == ["step-00000004"]
    assert lazyckpt.latest([mem]).step == 4
