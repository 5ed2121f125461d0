"""One DeepSpeed ``save_checkpoint`` as the engine tracks it (``Tag``): from ``create`` to its commit; ``as_cloned``
for the MoE save."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo

from lazyckpt.core.handle import Completion, SaveHandle, SaveStats
from lazyckpt.deepspeed._levels import LevelCopy


@dataclass(eq=False)
class Tag:
    """One ``create`` .. ``commit`` of DeepSpeed: a tag folder (``folder``) and/or files saved elsewhere."""

    info: CheckpointCommitInfo
    final: str  # <save_dir>/<tag>
    folder: bool = False  # DeepSpeed made the tag folder: every rank takes part in its decision
    n: int = -1  # the folder's commit number (the same on every rank: every rank makes the tag folder)
    staging: str = ""
    handles: list[SaveHandle] = field(default_factory=list)  # saves into the staging folder
    direct: list[SaveHandle] = field(default_factory=list)  # saves elsewhere (save_16bit_model)
    finished: threading.Event = field(default_factory=threading.Event)
    handed: bool = False  # handed over to its commit (once): the commit thread's, or its level's thread
    staged: threading.Event = field(default_factory=threading.Event)  # the hand-over's copies are done
    error: BaseException | None = None  # this rank's failure before the commit (the decision fails everywhere)
    seen: bool = False  # that failure was raised to the caller already: not raised again by the engine
    epoch: int = 0  # a synchronous save from a signal handler since its create: it writes no ``latest``
    deferred: list[Callable[[], None]] = field(default_factory=list)  # run on the commit thread (``defer``)
    completion: Completion | None = None  # the tag's handle (``handle_of``): done when published or failed
    names: list[str] = field(default_factory=list)  # this rank's files in the tag folder
    level: int = 0  # with levels: the level ``final`` is in
    step: int = -1  # with levels: the engine's global step it was saved at
    copies: tuple[LevelCopy, ...] = ()  # with levels: the slower levels due, each numbered in ``_make_folder``
    promoted: set[int] = field(default_factory=set)  # levels whose copy ran (``DeepSpeedLevels.promote``)
    leveled: SaveHandle | None = None  # a save to levels: done once every due level holds it (or failed there)
    t0: float = field(default_factory=time.perf_counter)

    @property
    def routed(self) -> bool:
        """A save to levels (``DeepSpeedLevels.begin``): its commits run on the level runner's threads."""
        return self.leveled is not None


def tag_stats(tag: Tag) -> SaveStats:
    """The tag's stats: its files' bytes summed, its times from ``create``."""
    files = [h.stats for h in tag.handles + tag.direct if h.stats is not None]
    written = sum(s.write_s for s in files)
    nbytes = sum(s.bytes for s in files)
    return SaveStats(
        path=tag.final, bytes=nbytes, file_bytes=sum(s.file_bytes for s in files),
        blocked_s=sum(s.blocked_s for s in files), staged_s=max((s.staged_s for s in files), default=0.0),
        durable_s=time.perf_counter() - tag.t0, write_s=written, write_gbps=nbytes / written / 1e9 if written else 0.0,
        guard_wait_s=sum(s.guard_wait_s for s in files),
    )  # fmt: skip


def same_path(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def as_cloned(item: Any) -> Any:
    """``item``'s containers as DeepSpeed's ``clone_tensors_for_torch_save`` rebuilds them (a tuple subclass such as
    ``torch.Size`` becomes a tuple), its tensors themselves: the MoE save's files equal to stock's, with no copy."""
    if isinstance(item, list):
        return [as_cloned(v) for v in item]
    if isinstance(item, tuple):
        return tuple(as_cloned(v) for v in item)
    if isinstance(item, dict):
        return type(item)({k: as_cloned(v) for k, v in item.items()})
    return item
