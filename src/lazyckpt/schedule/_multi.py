"""``MultiLevel``: the multi-level saver behind ``LazyCheckpointer(levels=...)`` and Accelerate's folders.

It is the ``Runner``'s producer of files and folders (``_runner.py``): one core save on the caller's
thread, copies on the level threads. It owns the error ledger, the remote tier and the staging
folder, and uses the core checkpointer through its public methods only.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, Protocol

from lazyckpt.core import remote as _remote
from lazyckpt.core.handle import SaveHandle
from lazyckpt.core.job import error_context
from lazyckpt.core.report import ErrorLedger, Report
from lazyckpt.errors import SaveRefusedError, WriteError
from lazyckpt.levels import Level, LevelError, Naming, check_step
from lazyckpt.options import CheckpointerOptions
from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry

from . import _copy
from ._handle import SOURCE, not_due
from ._runner import Feed, Runner, written
from ._schedule import WARN_AFTER_S


def check_levels(levels: tuple[Any, ...]) -> None:
    """``TypeError`` unless ``levels`` is a non-empty sequence of ``Level``."""
    if not levels or not all(isinstance(lv, Level) for lv in levels):
        raise TypeError("levels must be a non-empty list of lazyckpt.Level")


def refuse_replicas(levels: tuple[Any, ...], who: str) -> None:
    """``ValueError`` for a level with ``replicas`` given to a saver ``who`` that saves from one
    process only."""
    for i, level in enumerate(levels):
        if getattr(level, "replicas", 0):
            raise ValueError(
                f"level {i} ({level.path}): replicas={level.replicas} needs torch.distributed and a "
                "node-local level of a checkpointer built on every rank (lazyckpt.distributed."
                "DistributedCheckpointer, LazyCheckpointer(levels=) saved by rank 0, Accelerate's install(levels=) "
                f"in a job of several processes); {who} saves from one process and cannot hold copies in peers' "
                "memory (use replicas=0 here)"
            )


class Saver(Protocol):
    """What the multi-level saver needs of its ``LazyCheckpointer`` (no import of the facade)."""

    def save(self, obj: Any, path: str) -> SaveHandle: ...
    def raise_errors(self) -> None: ...
    def remove(self, path: str) -> Any: ...
    def wait_staged(self, timeout: float | None = None) -> None: ...


logger = logging.getLogger(__name__)


class MultiLevel:
    """The multi-level saver of one checkpointer: file checkpoints (``folder=False``) or folder
    checkpoints (``folder=True``; named by ``naming``, default ``step-<8 digits>``). ``reuse``: the
    checkpointer's page reuse for dropped files, or None. ``replicate``: allow a level with ``replicas``
    (collective: built on every rank). ``protect``: as for ``Runner``. ``remove``: how retention deletes
    (default: the checkpointer's ``remove``, a failure raised once like a failed save's)."""

    def __init__(
        self,
        ckpt: Saver,
        levels: tuple[Level, ...],
        options: CheckpointerOptions,
        *,
        folder: bool = False,
        reuse: Callable[[str], bool] | None = None,
        replicate: bool = False,
        naming: Naming | None = None,
        protect: Callable[[int], Collection[str]] = lambda index: (),
        remove: Callable[[str], Any] | None = None,
    ) -> None:
        check_levels(levels)
        self._remove = remove
        if naming is not None and not folder:
            raise ValueError("naming is for folder checkpoints")
        self.naming = naming
        if not replicate:
            refuse_replicas(levels, "this saver")
        from lazyckpt.cluster import SingleWriter, replicated_index

        replicated = replicated_index(levels)
        # collective: rank 0 writes, the next nodes hold copies
        self._single = None if replicated is None else SingleWriter(levels, replicated, options.fsync)
        self._replicated = replicated
        if len({lv.path for lv in levels}) != len(levels):
            raise ValueError("two levels share a path; give each level its own folder")
        self.ckpt = ckpt
        self._reuse = reuse
        self.levels = levels
        self.options = options
        self.folder = folder
        self._cond = reentry.condition()
        self._ledger = ErrorLedger()
        self.runner = Runner(levels, self, options.storage_options, folder=folder, naming=naming, protect=protect)
        self._tier: _remote.RemoteTier | None = None
        self._staging: str | None = None
        self._counter = itertools.count()
        self._memory_checked = False
        self._sourced: set[int] = set()  # levels the core saver wrote into (their files may be reused)
        self._closed = False
        for i, level in enumerate(levels):
            if not level.is_url:
                try:
                    os.makedirs(level.path, exist_ok=True)
                except OSError as exc:  # a file at its name, no permission: the level is unusable
                    raise LevelError(
                        f"lazyckpt: level {i} ({level.path}): cannot use it as a level folder: {exc}",
                        i, level.path, -1, level.path, errno=exc.errno,
                    ) from exc  # fmt: skip
                _fs.cleanup_temporaries(level.path)  # copies a killed process left half-done

    # -- caller side ------------------------------------------------------------------------------

    def save(self, obj: Any, step: int, due: Sequence[int] | None = None) -> SaveHandle:
        """Save ``obj`` to every level due at ``step`` (caller's thread). ``due``: level indices to
        save to (default: those with ``step % every == 0``)."""

        def produce(path: str) -> SaveHandle:
            return self.ckpt.save(obj, path)

        return self.save_with(step, produce, nbytes=lambda: _copy.tensor_bytes(obj), due=due)

    def save_with(
        self,
        step: int,
        produce: Callable[[str], SaveHandle],
        nbytes: Callable[[], int] | None = None,
        due: Sequence[int] | None = None,
    ) -> SaveHandle:
        """Save ``step`` to every due level: ``produce(path)`` saves at the fastest due level's path
        (staging for a URL) and returns its handle. ``nbytes()``: size for the memory check. With a
        replicated level only global rank 0 may save (else ``SaveRefusedError``)."""
        step = check_step(step)
        t0 = time.perf_counter()
        if self._single is not None and self._single.rank != 0:
            raise SaveRefusedError(
                f"rank {self._single.rank}: with a level with replicas, global rank 0 alone saves (the job's one "
                "writer; this rank's checkpointer holds copies or nothing)"
            )
        self.ckpt.raise_errors()  # an earlier save's unseen error first, as save() does
        runner = self.runner
        due = runner.due(step, due)
        if not due:
            return not_due(step, t0)
        if not self._memory_checked and nbytes is not None:
            self._memory_checked = True
            # the writer's node holds its own steps only
            own = tuple(dataclasses.replace(lv, replicas=0) for lv in self.levels)
            _copy.check_memory(own, nbytes())
        first = due[0] if not self.levels[due[0]].is_url else None
        targets = due[1:] if first is not None else due
        skip = self.options.on_backpressure == "skip"
        admitted = [i for i in targets if runner.admit(i, step, skip, self.ckpt.wait_staged, WARN_AFTER_S)]
        src = self.path(first, step) if first is not None else self._staging_path(step)
        if first is not None:
            self._sourced.add(first)
        feed = runner.begin(step, first, src, admitted, pin_save=True)
        # a failed write into the fastest level (or its staging file) becomes that level's LevelError
        token = error_context.set(self._level_failure(due[0], step))
        try:
            runner.sweep_once()
            source = produce(src)
        except BaseException:
            runner.abandon(feed, admitted, pin_save=True)
            raise
        finally:
            error_context.reset(token)
        if self._single is not None and first is not None and first == self._replicated:
            single = self._single  # added before the runner's callback: queued before the handle is done

            def replicate_source(h: SaveHandle, single: Any = single, path: str = src) -> None:
                if written(h):
                    single.submit(step, path)

            source.add_done_callback(replicate_source)
        part = SOURCE if first is None else first
        handle = runner.parts(feed, source, self.path(due[0], step), [part, *admitted], t0)
        handle.levels_skipped = [i for i in targets if i not in admitted]
        runner.start(feed, admitted, unpin_save=True)
        return handle

    def claim(self, step: int) -> None:
        """Mark ``step`` as this saver's at its fastest due level before ``save_with``, so retention
        does not take a folder other processes write into first for an earlier run's step."""
        self.runner.claim(step)

    def path(self, index: int, step: int) -> str:
        """Level ``index``'s checkpoint of ``step``: its file, or its folder (``folder=True``)."""
        level = self.levels[index]
        if self.naming is not None:
            return level.join(self.naming.name(step))
        return level.folder(step) if self.folder else level.file(step)

    def take_errors(self) -> list[BaseException]:
        return self._ledger.take()

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every save and replication (confirming on this thread); else ``TimeoutError``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.runner.drain(timeout)
        if self._single is not None and not self._single.drain(
            None if deadline is None else max(0.0, deadline - time.monotonic())
        ):
            raise TimeoutError(f"the copies to the other nodes' memory not done after {timeout} s")

    def close(self) -> None:
        """Stop the level threads, the replication, the tier; remove staging. Call after ``drain``."""
        if self._closed:
            return
        self._closed = True
        self.runner.close()
        if self._single is not None:
            self._single.close()
        if self._tier is not None:
            self._tier.close()
        if self._staging is not None:
            shutil.rmtree(self._staging, ignore_errors=True)

    @property
    def skipped_copies(self) -> int:
        """Level copies skipped so far."""
        return self.runner.skipped_copies

    # -- the runner's producer (``_runner.LevelProducer``) -------------------------------------------

    def promote(self, index: int, feed: Feed) -> LevelError | None:
        error = self._copy_to(index, feed.step, feed.path)
        if error is None and self._single is not None and index == self._replicated:
            self._single.submit(feed.step, self.path(index, feed.step))
        return error

    def ended(self, index: int, feed: Feed) -> None:
        pass

    def run(self, item: Any) -> None:  # pragma: no cover - MultiLevel queues no items of its own
        raise TypeError(f"lazyckpt: unexpected level item {item!r}")

    def publish(self, report: Report) -> None:
        self._ledger.publish(report)

    def remove(self, path: str) -> Any:
        return self.ckpt.remove(path) if self._remove is None else self._remove(path)

    def remote_tier(self) -> _remote.RemoteTier:
        return self._remote_tier()

    def reuse(self, index: int) -> Callable[[str], bool] | None:
        return self._reuse if self.levels[index].reuse_pages and index in self._sourced else None

    def discard(self, path: str) -> None:
        self._discard_staging(path)

    def _level_failure(self, index: int, step: int) -> Callable[[BaseException], BaseException]:
        """Maps a ``WriteError`` into level ``index`` to its ``LevelError``; other errors pass."""
        level, dst = self.levels[index], self.path(index, step)

        def describe(exc: BaseException) -> BaseException:
            if not isinstance(exc, WriteError) or isinstance(exc, LevelError):
                return exc
            err = LevelError(
                f"lazyckpt: level {index} ({level.path}): save of step {step} to {dst} failed: {exc}",
                index, level.path, step, dst, errno=exc.errno,
            )  # fmt: skip
            err.__cause__ = exc
            return err

        return describe

    def _copy_to(self, index: int, step: int, src: str) -> LevelError | None:
        level = self.levels[index]
        dst = self.path(index, step)
        try:
            if level.is_url and self.folder:
                _copy.upload_folder(self._remote_tier(), src, dst)
            elif level.is_url:
                tier = self._remote_tier()
                tier.transfer(dst, *tier.resolve(dst), src)
            elif self.folder:
                _copy.copy_tree(src, dst, self.options.fsync)
            else:
                _copy.copy_file(src, dst, self.options.fsync)
        except Exception as exc:
            code = getattr(exc, "errno", None)
            err = LevelError(
                f"lazyckpt: level {index} ({level.path}): copy of step {step} to {dst} failed: {exc}",
                index, level.path, step, dst, errno=code if isinstance(code, int) else None,
            )  # fmt: skip
            err.__cause__ = exc
            logger.debug("lazyckpt: %s", err)
            return err
        return None

    # -- resources --------------------------------------------------------------------------------

    def _remote_tier(self) -> _remote.RemoteTier:
        with self._cond:
            if self._tier is None:
                self._tier = _remote.RemoteTier(self.options, self._ledger.publish, self.runner.callbacks)
            return self._tier

    def _staging_path(self, step: int) -> str:
        with self._cond:
            if self._staging is None:
                base = self.options.local_dir
                if base is not None:
                    os.makedirs(base, exist_ok=True)
                self._staging = tempfile.mkdtemp(prefix="lazyckpt-levels-", dir=base)
            suffix = "" if self.folder else ".pt"
            return os.path.join(self._staging, f"{next(self._counter):06d}-step-{step:08d}{suffix}")

    def _discard_staging(self, path: str) -> None:
        if self.folder:
            shutil.rmtree(path, ignore_errors=True)
            return
        try:
            _fs.unlink(path)
        except OSError:
            pass
