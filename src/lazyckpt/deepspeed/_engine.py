"""``LazyCheckpointEngine``: DeepSpeed's pluggable checkpoint engine, lazy, publishing whole tag folders.

One ``engine.save_checkpoint`` on every rank: ``create`` opens the tag; ``makedirs(<save_dir>/<tag>)`` makes a
hidden staging folder beside it instead; every ``save`` is a core lazy save into it (tensors copied in the
background: DeepSpeed changes them only in ``step()``). DeepSpeed calls the decoupled engine's ``commit`` in the
next ``step()`` at the accumulation boundary, before the update: it waits only for this rank's copies and hands
the tag to the commit thread, which waits for this rank's files, then takes part in the folder commit
(``lazyckpt.distributed.folder_commit``: all ranks or none) and writes ``latest`` after it (DeepSpeed's is off).

Threads: the training thread (every DeepSpeed call), one commit thread (with levels: each level's thread of the
level runner instead), one heartbeat thread and one callback thread per engine, and the core checkpointer's.
Errors of a tag are raised once, on every rank, at the next ``create``, ``load``, ``cleanup`` or ``wait()`` (or a
load or conversion that publishes it first); a ``save_checkpoint`` that raises (not for an earlier file's write)
fails its tag on every rank, raised there only.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointCommitInfo, CheckpointEngine

from lazyckpt.checkpointer import LazyCheckpointer
from lazyckpt.cluster import Scope
from lazyckpt.core import exit as _exit
from lazyckpt.core.handle import CallbackRunner, Completion, SaveHandle, claim_error_of
from lazyckpt.core.plan import tensors_in
from lazyckpt.deepspeed import _levels
from lazyckpt.deepspeed._levels import DeepSpeedLevels, LevelCopy
from lazyckpt.deepspeed._tag import Tag, as_cloned, same_path, tag_stats
from lazyckpt.distributed.folder_commit import FolderCommit
from lazyckpt.errors import CheckpointerClosedError, DistributedLevelError
from lazyckpt.options import CheckpointerOptions
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker

logger = logging.getLogger("lazyckpt.deepspeed")

_LIVE: weakref.WeakSet[LazyCheckpointEngine] = weakref.WeakSet()  # every engine not closed, for publish_pending


class LazyCheckpointEngine(CheckpointEngine):
    """A DeepSpeed ``CheckpointEngine`` that makes ``save_checkpoint`` return before the disk is touched.

    Set it on every rank after ``deepspeed.initialize`` (``engine.checkpoint_engine = LazyCheckpointEngine()``),
    or let :func:`lazyckpt.deepspeed.install` do it. ``options`` / ``core_options``: the core's
    (:class:`lazyckpt.CheckpointerOptions`); ``commit_timeout``: seconds the ranks wait for each other's files
    once their own are durable. The tag folder appears whole, and ``latest`` names it only after that.
    ``wait()`` blocks until every tag handed over is published or failed, and raises the first unseen error.
    """

    def __init__(
        self,
        config_params: Any = None,
        *,
        options: CheckpointerOptions | None = None,
        commit_timeout: float = 600.0,
        **core_options: Any,
    ) -> None:
        super().__init__(config_params)
        self.name = "LazyCheckpointEngine"
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("LazyCheckpointEngine needs torch.distributed initialized (deepspeed.initialize does)")
        if commit_timeout <= 0:
            raise ValueError("commit_timeout must be positive")
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.commit_timeout = float(commit_timeout)
        self.checkpointer = LazyCheckpointer(options, **core_options)
        self._folders = FolderCommit(self.rank, self.world_size, self.commit_timeout, self.checkpointer.fsync)
        self.token = self._folders.token  # the same on every rank
        self._lock = reentry.Lock()
        self._open: Tag | None = None  # created, not yet handed to the commit thread
        self._queued: list[Tag] = []  # handed over, not yet finished
        self._errors: list[BaseException] = []  # failed tags nobody has seen yet
        self._count = 0
        self._cleaned: set[str] = set()
        self._closed = False
        self._saving: Tag | None = None  # the tag the save_checkpoint in progress opened (``saving``)
        self._saving_thread: int | None = None  # the thread running that save_checkpoint
        self._epoch = 0  # synchronous saves from signal handlers so far (``supersede``)
        self.stepped = False  # an optimizer step (accumulation boundary) ran since this engine was set
        self._recent: deque[Tag] = deque(maxlen=16)  # finished tags, for ``handle_of``
        self._copying: list[Tag] = []  # routed tags handed over whose copies to slower levels may be running
        self.levels: DeepSpeedLevels | None = None  # set by ``install(engine, levels=...)`` (``route``)
        self._route: tuple[int, int, tuple[LevelCopy, ...]] | None = None  # the next create's (level, step, copies)
        self._callbacks = CallbackRunner()  # the tags' handles' done-callbacks, never on the commit thread
        self._worker: Worker[Tag] = Worker("lazyckpt-deepspeed-commit", self.commit_tag, lazy=True)
        _exit.register(self, _drain_at_exit, layer=_exit.INTEGRATION)
        _LIVE.add(self)

    # -- DeepSpeed's calls, all on the training thread ---------------------------------------------

    def create(self, info: CheckpointCommitInfo) -> None:
        self.raise_errors()
        if self._closed:
            raise CheckpointerClosedError("this LazyCheckpointEngine is closed")
        self.hand_over_open()  # saved again with no step between: nothing changed since
        tag = Tag(info, os.path.join(os.path.abspath(info.save_dir), str(info.tag)), epoch=self._epoch)
        tag.completion = Completion(tag.final)
        tag.completion.bind(confirm=lambda _timeout: self._hand_over(tag))  # a wait on it hands it over
        if self._route is not None and self.levels is not None:  # the level runner's source save, copies queued
            (tag.level, tag.step, tag.copies), self._route = self._route, None
            self.levels.begin(tag)
        self._open = self._saving = tag

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        tag = self._open
        if tag is not None and os.path.abspath(path) == tag.final:
            self._make_folder(tag)
            return
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        tag = self._open
        inside = tag is not None and os.path.dirname(os.path.abspath(path)) == tag.final
        if inside:
            assert tag is not None
            self._make_folder(tag)
            target = os.path.join(tag.staging, os.path.basename(path))
            tag.names.append(os.path.basename(path))
        else:
            target = path
        if inspect.currentframe().f_back.f_code.co_name == "_save_moe_checkpoint":  # type: ignore[union-attr]
            state_dict = as_cloned(state_dict)  # stock clones what its MoE save hands over: its containers
        # DeepSpeed changes what it hands over only in step(), after commit() waited for the copies.
        self.checkpointer.declare_frozen(*(tensors_in(state_dict) or ()))
        while True:  # an earlier file's error is its tag's, reported by its commit on every rank: never raised here
            try:
                handle = self.checkpointer.save(state_dict, target)
                break
            except Exception as exc:
                if not claim_error_of([h for t in [*self._tags(), *self._recent] for h in t.handles + t.direct], exc):
                    raise
        if tag is None:
            handle.wait()  # no create() before: as stock, the file is complete when save() returns
        elif inside:
            tag.handles.append(handle)
        else:
            tag.direct.append(handle)

    def commit(self, info: CheckpointCommitInfo) -> bool:
        tag, key = self._open, (info.tag, os.path.abspath(info.save_dir))
        if tag is None or (tag.info.tag, os.path.abspath(tag.info.save_dir)) != key:
            return True  # not the open tag's: nothing of ours to commit
        self._hand_over(tag)
        for handle in tag.direct:  # save_16bit_model commits directly: its file complete on return, as stock
            handle.wait()
        return True

    def get_commit_info(self) -> CheckpointCommitInfo | None:
        self.stepped = True  # DeepSpeed asks at every accumulation boundary, before the optimizer step
        tag = self._open
        if tag is None or not tag.folder:
            return None
        return CheckpointCommitInfo(tag=tag.info.tag, save_dir=tag.info.save_dir, save_latest=False)

    def load(self, path: str, map_location: Any = None) -> Any:
        self.wait()
        publish_pending(path)
        return torch.load(path, map_location=map_location, weights_only=False)

    def is_decoupled(self) -> bool:
        return True

    def preserves_storage_sharing(self) -> bool:
        return False  # no clone before save(): the copies are lazyckpt's

    def cleanup(self) -> None:
        self.wait()

    # -- the caller's ------------------------------------------------------------------------------

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """Around one ``engine.save_checkpoint`` (``install()`` wraps it): if it raises, the tag it opened is
        handed over failed (its files may be missing), so the decision fails it on every rank instead of a
        later step publishing it; that error, raised here, is not raised again by this engine."""
        self._saving, self._saving_thread = None, threading.get_ident()
        try:
            yield
        except BaseException as exc:
            tag = self._saving
            if tag is not None and not tag.handed:
                tag.error, tag.seen = exc, True
                self._hand_over(tag)
            raise
        finally:
            self._saving = self._saving_thread = None
            if self._route is not None and self.levels is not None:  # a save that never reached create()
                self.levels.refund([c.index for c in self._route[2]])
            self._route = None

    def abandon(self, save_dir: str, error: BaseException) -> None:
        """The open tag saved into ``save_dir`` fails with ``error`` (a framework call around it raised; that
        error was raised to the caller) on every rank, handed over now."""
        tag = self._open
        if tag is not None and not tag.handed and same_path(os.path.dirname(tag.final), save_dir):
            tag.error, tag.seen = error, True
            self._hand_over(tag)

    def supersede(self, final: str) -> None:
        """A signal handler that interrupted lazyckpt saves synchronously through the stock engine (``install()``
        swaps it in): the pending tags write no ``latest`` any more, and one of the same folder ``final`` fails
        (the synchronous save is the newer). Takes no lock (the interrupted frame may hold it)."""
        self._epoch += 1
        for tag in self._tags():
            if same_path(tag.final, final) and tag.error is None:
                tag.error = RuntimeError(f"lazyckpt: {tag.final} was saved again synchronously from a signal handler")
                tag.seen = True

    def handle_of(self, save_dir: str, tag: str | None = None) -> SaveHandle | None:
        """The handle of the tag ``save_checkpoint(save_dir, tag)`` made (``tag`` None: the newest tag of
        ``save_dir``, whatever its name; None: no such tag): done once the tag folder is published (and
        ``latest`` written) or failed. A wait on it hands an open tag over first, as the next ``step()`` would;
        its error is also raised once by this engine."""
        live = self._tags()  # (before the finished ones: a tag finishing meanwhile is in one of the two)
        for candidate in reversed([*list(self._recent), *live]):
            final, completion = candidate.final, candidate.completion
            named = tag is None or os.path.basename(final) == str(tag)
            if completion is not None and named and same_path(os.path.dirname(final), save_dir):
                return completion.handle
        return None

    def wait(self, timeout: float | None = None) -> None:
        """Hand over an open tag, wait until every tag is published or failed (and copied to its slower levels);
        raise the first unseen error. ``TimeoutError`` if ``timeout`` seconds pass first. From a signal handler
        that interrupted lazyckpt: returns at once (``reentry.wait_refused``)."""
        if reentry.wait_refused("LazyCheckpointEngine.wait()"):
            return
        self.hand_over_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            queued = list(self._queued)
        for tag in queued:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not tag.finished.wait(left):
                raise TimeoutError(f"lazyckpt: the DeepSpeed checkpoint {tag.final} is still being committed")
        for tag in self._copies_running():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if tag.leveled is not None and not tag.leveled.wait_done(left):
                raise TimeoutError(f"lazyckpt: the DeepSpeed checkpoint {tag.final} is still being copied")
        self.raise_errors()

    def route(self, level: int, step: int, copies: Sequence[int]) -> None:
        """Training thread: the next ``save_checkpoint`` goes to level ``level`` at ``step``, then ``copies``
        (admitted to their backlogs: ``DeepSpeedLevels.admit``)."""
        assert self.levels is not None
        self._route = (level, step, tuple(LevelCopy(i, os.path.abspath(self.levels.levels[i].path)) for i in copies))

    def hand_over_open(self) -> None:
        """The open tag (if any) to its commit (``_open`` read once: another thread may clear it)."""
        tag = self._open
        if tag is not None:
            self._hand_over(tag)

    def report(self, error: BaseException) -> None:
        """A background error of this engine's (a slower level's copy), raised once like a tag's."""
        with self._lock:
            self._errors.append(error)

    def defer(self, job: Callable[[], None]) -> None:
        """Run ``job`` on the commit thread once this rank's files of the open tag are durable, before the folder
        decision (its error fails the tag on every rank); at once when no tag is open (or from a signal handler
        that interrupted lazyckpt)."""
        if reentry.reentered():
            job()
            return
        with self._lock:
            tag = self._open
            if tag is not None and not tag.handed:
                tag.deferred.append(job)
                return
        job()

    def pending_into(self, path: str) -> bool:
        """Whether a tag not yet published is read by a load of ``path`` (its ``save_dir``, the tag folder or
        a file in it)."""
        target = os.path.realpath(path)
        for tag in [*self._tags(), *self._copies_running()]:
            for where in (tag.final, *(os.path.join(c.save_dir, os.path.basename(tag.final)) for c in tag.copies)):
                final = os.path.realpath(where)
                if target in (final, os.path.dirname(final)) or target.startswith(final + os.sep):
                    return True
        return False

    def raise_errors(self) -> None:
        """Raise the first failed tag's error not raised yet (each is raised once)."""
        with self._lock:
            errors, self._errors = self._errors, []
        if errors:
            for extra in errors[1:]:
                logger.error("lazyckpt: another DeepSpeed checkpoint failed too: %s", extra)
            raise errors[0]

    def close(self) -> None:
        """``wait()``, then stop the threads (and the checkpointer); the engine saves no more."""
        if self._closed:
            return
        try:
            self.wait()
        finally:
            self._closed = True
            self._worker.stop()
            self._callbacks.stop()
            if self.levels is not None:
                self.levels.close()
            self._folders.close()
            self.checkpointer.close()
            _exit.unregister(self)
            _LIVE.discard(self)

    # -- internals ---------------------------------------------------------------------------------

    def _make_folder(self, tag: Tag) -> None:
        """The tag's staging folder (once): numbered here, not in ``create``, so that a ``create`` on one rank
        only (``save_16bit_model``) never shifts the numbers the ranks agree on."""
        if not tag.folder:
            tag.folder = True
            tag.n, self._count = self._count, self._count + 1 + len(tag.copies)
            tag.copies = tuple(LevelCopy(c.index, c.save_dir, tag.n + 1 + k) for k, c in enumerate(tag.copies))
            tag.staging = self._folders.staging(tag.final, tag.n)
            save_dir = os.path.dirname(tag.final)
            if self._leads(tag.level) and save_dir not in self._cleaned:  # dead jobs' staging folders (ours live)
                self._folders.cleanup_leftovers(save_dir)
                self._cleaned.add(save_dir)
        os.makedirs(tag.staging, exist_ok=True)

    def _hand_over(self, tag: Tag) -> None:
        """The tag's copies done (the optimizer may change its tensors), its folder to the commit thread (a routed
        tag's: its level's thread). It stays the open tag until queued: a ``create`` or ``commit`` meanwhile
        waits here (the optimizer step after it, the next tag's copies queued after it, on every rank). Not while
        its ``save_checkpoint`` runs on another thread (that save's step or wait hands it over). A region of
        ``reentry``: a signal handler interrupting it saves synchronously, never waiting for it here."""
        if tag is self._saving and self._saving_thread not in (None, threading.get_ident()):
            return
        with reentry.inside():
            self._hand_over_now(tag)

    def _hand_over_now(self, tag: Tag) -> None:
        with self._lock:
            first = not tag.handed
            tag.handed = True
        if not first:  # another thread hands it over: its copies are done, and it is queued, once that is past
            if reentry.depth() <= 1:  # (deeper: this thread interrupted its own hand-over: never wait for itself)
                tag.staged.wait()
            return
        for handle in tag.handles + tag.direct:
            try:
                handle.wait_staged()
            except BaseException:  # noqa: BLE001 - the commit thread reports it, on every rank alike
                pass
        try:  # queued before a create() waiting here queues the next tag's copies: the same order on every rank
            if not tag.folder:  # (a routed tag always makes its folder: without one its copies must not run)
                never = RuntimeError(f"lazyckpt: {tag.final} was never made") if tag.routed else None
                self._finish(tag, tag.error or never)
                return
            with self._lock:
                self._queued.append(tag)
                if tag.routed:  # (the done ones dropped here)
                    self._copying = [*self._copies_running(), tag]
            if not (self.levels.submit(tag) if tag.routed and self.levels is not None else self._worker.submit(tag)):
                self._finish(tag, CheckpointerClosedError(f"lazyckpt: {tag.final} was not committed (closed)"))
        finally:
            with self._lock:
                if self._open is tag:
                    self._open = None
            tag.staged.set()

    def commit_tag(self, tag: Tag) -> None:
        """The commit thread (a routed tag: its level's thread): this rank's files durable, then the decision;
        rank 0 publishes, then ``latest``."""
        own: BaseException | None = None
        for handle in tag.handles:
            try:
                handle.wait()
            except BaseException as exc:  # noqa: BLE001 - reported to every rank
                own = own or exc
        own = tag.error or own  # (read after the waits: ``supersede`` may set it meanwhile)
        for job in tag.deferred if own is None else ():
            try:
                job()
            except BaseException as exc:  # noqa: BLE001 - reported to every rank
                own = own or exc
        error: BaseException | None = RuntimeError(f"lazyckpt: committing {tag.final} was interrupted")
        try:
            after = self._after_publish(tag, tag.level, tag.final)
            error = self._folders.commit(tag.n, tag.final, own, after, self._scope(tag.level))
            if self.levels is not None:  # its replicas (a level with replicas), on every rank alike
                self.levels.committed(tag.level, tag.step, tag.final, tag.names, error is None)
        finally:  # whatever escapes, wait() is never left waiting for this tag
            self._finish(tag, error)

    def _after_publish(self, tag: Tag, level: int, final: str) -> Callable[[], None] | None:
        """The folder owner's job once ``final`` is in place: ``latest`` names it (unless ``save_latest=False`` or
        a synchronous save from a signal handler came since). (A level's retention is the runner's, after.)"""
        if not self._leads(level) or not tag.info.save_latest:
            return None
        save_dir, name = os.path.dirname(final), os.path.basename(final)

        def after() -> None:
            if tag.epoch == self._epoch:
                _levels.write_latest(save_dir, name, self.checkpointer.fsync)

        return after

    def copy_tag(self, tag: Tag, copy: LevelCopy, failed: BaseException | None) -> DistributedLevelError | None:
        """A slower level's thread, after ``tag``'s decision (``failed``: this rank's outcome of it): this rank's
        files of it into that level's staging folder, then that folder's commit (every rank or none, every rank
        taking part: a rank whose fast level failed fails it at once). Returns a published tag's failed copy:
        that level's error."""
        assert self.levels is not None
        final = os.path.join(copy.save_dir, os.path.basename(tag.final))
        own: BaseException | None = failed
        names: list[str] = []
        try:  # every rank takes part in the names' exchange, whatever its outcome so far
            gather = functools.partial(self._folders.all_gather, channel=str(copy.index))  # the level thread's
            names = self.levels.share(copy.index, tag.names if own is None else [], gather)
        except Exception as exc:  # noqa: BLE001 - reported to every rank by the decision
            own = own or exc
        if own is None:
            try:
                if self._leads(copy.index) and copy.save_dir not in self._cleaned:  # dead jobs' staging folders
                    self._folders.cleanup_leftovers(copy.save_dir)
                    self._cleaned.add(copy.save_dir)
                _levels.copy_own_files(tag.final, names, self._folders.staging(final, copy.n), self.checkpointer.fsync)
                if self._leads(copy.index):  # DeepSpeed's recovery scripts, beside the tags as stock copies them
                    _levels.copy_scripts(os.path.dirname(tag.final), copy.save_dir, self.checkpointer.fsync)
            except BaseException as exc:  # noqa: BLE001 - reported to every rank by the decision
                own = exc
        after = self._after_publish(tag, copy.index, final) if own is None else None
        error = self._folders.commit(copy.n, final, own, after, self._scope(copy.index))
        self.levels.committed(copy.index, tag.step, final, names, error is None)
        if error is None or failed is not None:  # (a failed fast level is reported as itself)
            return None
        return _levels.level_error(copy, self.levels.levels[copy.index], tag.step, error)

    def _copies_running(self) -> list[Tag]:
        """The routed tags handed over whose level handle is not done. Takes no lock (a signal handler may call
        it: ``list()`` copies in one step under the GIL)."""
        return [t for t in list(self._copying) if t.leveled is None or not t.leveled.done()]

    def _tags(self) -> list[Tag]:
        """The tags handed over and not finished, then the open one. Takes no lock (a signal handler may call it)."""
        queued, tag = list(self._queued), self._open
        return [*queued, *([tag] if tag is not None else [])]

    def _leads(self, level: int) -> bool:
        return self.rank == 0 if self.levels is None else self.levels.leads(level)

    def _scope(self, level: int) -> Scope | None:
        return None if self.levels is None else self.levels.scopes[level]

    def _finish(self, tag: Tag, error: BaseException | None) -> None:
        with self._lock:
            if error is not None and not tag.seen:
                self._errors.append(error)
            if tag in self._queued:
                self._queued.remove(tag)
            self._recent.append(tag)
        if error is None:
            logger.info("lazyckpt: DeepSpeed checkpoint %s committed", tag.final)
        if tag.completion is not None:
            tag.completion.finish(None if error is not None else tag_stats(tag), error, runner=self._callbacks)
        tag.finished.set()


def publish_pending(path: str) -> None:
    """Publish first every tag of this process's engines that a load of ``path`` reads (a ``save_dir``, a tag
    folder or a file in it), waiting for them: a load sees what any engine here saved, as with stock's files,
    complete when ``save_checkpoint`` returned. Their errors are raised (once)."""
    for engine in list(_LIVE):
        if engine.pending_into(path):
            engine.wait()


def _drain_at_exit(engine: LazyCheckpointEngine) -> None:
    """Exit hook: the last tags published (an open one too: no step changed its tensors since)."""
    try:
        engine.wait()
    except BaseException as exc:  # noqa: BLE001 - nobody left to raise to
        logger.error("lazyckpt: a DeepSpeed checkpoint failed: %r", exc)
