"""Finding checkpoint files, and recognising folder checkpoints (Accelerate's among them), without loading anything."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from lazyckpt.commit.folder import marker_is_stale, pending_markers
from lazyckpt.storage.fs import is_temporary

#: File name endings treated as checkpoint files when a directory is given.
CHECKPOINT_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".safetensors", ".pkl")

# names accelerate's save_accelerator_state writes: <stem>[_<i>].<ext>
_ACC_FAMILIES = {
    "model": re.compile(r"^(?:model|pytorch_model)(?:_(\d+))?\.(?:safetensors|bin)$"),
    "optimizer": re.compile(r"^optimizer(?:_(\d+))?\.bin$"),
    "scheduler": re.compile(r"^scheduler(?:_(\d+))?\.bin$"),
    "sampler": re.compile(r"^sampler(?:_(\d+))?\.bin$"),
    "random_states": re.compile(r"^random_states_(\d+)\.pkl$"),
}


def is_checkpoint_name(name: str) -> bool:
    return name.endswith(CHECKPOINT_SUFFIXES) and not name.startswith(".")


def checkpoint_files(directory: str) -> list[str]:
    """Checkpoint files directly inside ``directory``, sorted (hidden files and temporaries excluded)."""
    names = sorted(n for n in os.listdir(directory) if is_checkpoint_name(n))
    return [os.path.join(directory, n) for n in names if os.path.isfile(os.path.join(directory, n))]


def temporaries(directory: str) -> list[str]:
    """lazyckpt temporaries in ``directory``: saves in progress, or left by a killed process."""
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if is_temporary(n))


def incomplete_problem(directory: str) -> str | None:
    """Why a folder checkpoint is incomplete (its lazyckpt pending markers), or None when it is not."""
    markers = pending_markers(directory)
    if not markers:
        return None
    dead = [m for m in markers if marker_is_stale(m)]
    why = (
        "left by a process of this host that died: that save will never finish"
        if len(dead) == len(markers)
        else "the process was killed or a write failed, or the save is still running"
    )
    return f"incomplete: lazyckpt save not durable yet ({len(markers)} pending marker(s), e.g. {markers[0]}); {why}"


def is_accelerate_folder(directory: str) -> bool:
    """True when ``directory`` holds files named as ``Accelerator.save_state`` names them."""
    names = os.listdir(directory)
    return any(_ACC_FAMILIES["model"].match(n) or _ACC_FAMILIES["random_states"].match(n) for n in names)


@dataclass
class FolderCheck:
    """Structure of an Accelerate checkpoint folder (file contents are verified separately)."""

    path: str
    files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_accelerate_folder(directory: str) -> FolderCheck:
    """Are all the files ``save_state`` writes present, and did every lazyckpt save into it finish?"""
    check = FolderCheck(directory, checkpoint_files(directory))
    incomplete = incomplete_problem(directory)
    if incomplete:
        check.problems.append(incomplete)
    for tmp in temporaries(directory):
        check.problems.append(f"unfinished write: {os.path.basename(tmp)} (interrupted or still running)")
    indices = _family_indices([os.path.basename(f) for f in check.files])
    if not indices["model"]:
        check.problems.append("no model file (model*.safetensors or pytorch_model*.bin)")
    if not indices["random_states"]:
        check.problems.append("random_states_0.pkl missing (every process writes one): the save did not finish")
    for family, found in indices.items():
        missing = sorted(set(range(max(found) + 1)) - found) if found else []
        if missing:
            check.problems.append(f"{family} file(s) with index {missing} missing (found {sorted(found)})")
    return check


def _family_indices(names: list[str]) -> dict[str, set[int]]:
    found: dict[str, set[int]] = {family: set() for family in _ACC_FAMILIES}
    for name in names:
        for family, pattern in _ACC_FAMILIES.items():
            m = pattern.match(name)
            if m:
                found[family].add(int(m.group(1) or 0))
    return found
