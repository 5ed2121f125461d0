"""DistributedCheckpointer: lazy sharded saves in DCP's format, committed on every rank or none."""

from __future__ import annotations

import dataclasses
import logging
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from datetime import timedelta
from typing import Any, overload

import torch.distributed as dist
from torch.distributed.checkpoint.utils import _DistWrapper

from lazyckpt.cluster import ReplicationStats, StoreExchange
from lazyckpt.core import exit as _exit
from lazyckpt.core import remote as _remote
from lazyckpt.core.handle import Completion, SaveHandle
from lazyckpt.levels import Level
from lazyckpt.resume import Found
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker

from ..checkpointer import LazyCheckpointer, producer_of
from ..errors import (
    CheckpointerClosedError,
    SaveRefusedError,
    UploadError,
)
from ..options import CheckpointerOptions
from ..options import merge as merge_options
from . import _commit
from ._commit import RankReport
from ._core import (
    classify_start_error,
    complete_handle,
    confirm_ready,
    local_outcome,
    resolve_handle,
    start_rank_file,
)
from ._decide import Decider, store_host_rank
from ._handle import DistributedSaveHandle, LocalPart, Save, extra_name, resolve_path, save_error
from ._levels import Context, DistributedLevels
from ._plan import PlanCache, RankPlan, plan_save
from ._upload import RemoteFolder

logger = logging.getLogger(__name__)


class DistributedCheckpointer(_exit.ClosedOnExit):
    """Saves sharded training state lazily on every rank, as a DCP checkpoint folder.

    Construct it on every rank of ``process_group`` after ``init_process_group`` (a collective: it
    creates its own gloo group). ``save(state, path)`` is collective too (every rank, same path, same
    order): it plans with DCP's ``DefaultSavePlanner`` on the caller's thread and returns; each rank's
    tensors are then copied and written in the background as ``LazyCheckpointer`` does, into a hidden
    staging folder that becomes ``path`` only once every rank's file is durable (a two-phase commit
    through the c10d store, never the training's process group). ``torch.distributed.checkpoint.load``
    reads the result with any world size.

    A rank's file is committed only once its training thread confirmed its lazy copies: at its next
    optimizer step, module forward pass or call into lazyckpt. A rank waiting alone in ``wait()`` is
    fine while the others train on; the save fails after ``commit_timeout`` only if another rank
    blocks in a collective with no forward pass or step in between. Call ``wait()`` on every rank to
    rule that out.

    Any rank's failure fails the save on every rank (``DistributedSaveError`` naming the ranks); a rank
    whose heartbeat stops fails it on the others within seconds. Staging folders of dead saves are
    removed by the next save into the same parent folder.

    ``path`` may be any fsspec URL: each rank writes its file on local disk, then uploads it; the
    coordinator uploads ``.metadata`` last, so a reader sees the whole new checkpoint or the previous
    one. A failed upload raises ``DistributedUploadError`` on every rank and deletes what was uploaded.

    Args:
        process_group: the ranks that save together (default: the default group). Only its ranks
            are used; its backend is not (nccl is fine).
        commit_timeout: seconds this rank waits, once its own file is durable (for a URL: uploaded),
            for the save to be committed; then the save fails on every rank still waiting. For
            URLs it must cover the slowest rank's upload beyond the fastest's.
        options: ``LazyCheckpointer``'s options as one ``lazyckpt.CheckpointerOptions``;
            ``on_backpressure`` must stay ``"block"``.
        levels: the levels (``lazyckpt.Level``, fastest first) for ``save(state, step=n)`` and
            ``latest()``; the same list on every rank (a node-local level's path may differ per
            node); the options' ``levels`` if not given. A URL level needs a faster local level
            whose ``every`` divides its own. A level's failure raises ``DistributedLevelError``
            alike on every rank; the other levels go on.
        **kwargs: the same options as keywords (they override those fields of ``options``).
    """

    def __init__(
        self,
        options: CheckpointerOptions | None = None,
        *,
        process_group: dist.ProcessGroup | None = None,
        commit_timeout: float = 600.0,
        levels: Sequence[Level] | None = None,
        **kwargs: Any,
    ) -> None:
        if options is not None and not isinstance(options, CheckpointerOptions):
            raise TypeError(
                f"DistributedCheckpointer takes a CheckpointerOptions or keyword options, got {type(options).__name__}"
            )
        options = merge_options(options, kwargs if levels is None else {**kwargs, "levels": levels})
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("DistributedCheckpointer needs torch.distributed initialized (init_process_group)")
        if options.on_backpressure != "block":
            raise ValueError("on_backpressure='skip' could skip a save on some ranks only; use 'block'")
        if commit_timeout <= 0:
            raise ValueError("commit_timeout must be positive")
        if options.levels is not None:
            DistributedLevels.check(options.levels)
        self.options = options
        self.commit_timeout = float(commit_timeout)
        if process_group is None:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=max(60.0, commit_timeout)))
        else:
            ranks = dist.get_process_group_ranks(process_group)
            self._group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=True)
        self._dist = _DistWrapper(self._group, True, 0)
        self.rank, self.world_size = self._dist.rank, self._dist.get_world_size()
        token = [uuid.uuid4().hex if self._dist.is_coordinator else None]
        dist.broadcast_object_list(token, src=self._dist.global_coordinator_rank, group=self._group)
        self._token = str(token[0])
        _commit.add_live(self._token)
        store = StoreExchange.default_store()
        self._proto = _commit.StoreProtocol(store, self._token, self.rank, self.world_size)
        # A thread of its own (the commit thread may wait long): a dead rank fails saves within seconds.
        self._liveness = _commit.Liveness(store, self._token, self.rank, self.world_size)
        self._liveness.start("lazyckpt-dist-heartbeat")
        self._store_host = store_host_rank(self._group, self.rank)
        self._inner = LazyCheckpointer(dataclasses.replace(options, levels=None))  # the levels are ours
        self._decider = Decider(
            self._proto, self._liveness, self.rank, self.world_size, self.commit_timeout, self._token, self._inner.fsync
        )
        self._lock = reentry.Lock()
        self._pending: list[Save] = []
        self._count = 0
        self._plan_cache = PlanCache()  # the previous global plan: reused while no rank's local plan changes
        self._closed = False
        self._committer: Worker[Save] = Worker("lazyckpt-dist-commit", self._commit_one)
        self._levels: DistributedLevels | None = None
        if options.levels is not None:  # collective: finds which ranks share each level's folder
            context = Context(self._inner, self._dist, self._decider, store, self._next_n, self._all_gather)
            try:
                self._levels = DistributedLevels(context, options.levels)
            except BaseException:  # a level folder no rank may use: on every rank alike, nothing left running
                self.close()
                raise
        # A URL level uploads from the level threads: drained while s3fs still works (core/exit.py)
        urls = self._levels is not None and self._levels.has_urls
        _exit.register(self, _close_at_exit, layer=_exit.DISTRIBUTED, early=urls)

    @property
    def replication(self) -> ReplicationStats | None:
        """This rank's replication so far (``ReplicationStats``; None without a level with ``replicas``)."""
        replicator = None if self._levels is None else self._levels.replicator
        return None if replicator is None else replicator.stats

    @property
    def levels(self) -> tuple[Level, ...]:
        """The levels given at construction (``()`` without); ``latest()`` finds their newest step."""
        return () if self._levels is None else self._levels.levels

    def latest(
        self, storage_options: dict[str, Any] | None = None, verify: bool = True, timeout: float = 600.0
    ) -> Found | None:
        """``lazyckpt.latest(self.levels)`` agreed among this checkpointer's ranks (collective): the
        same step everywhere, this rank's fastest copy that it can load (``storage_options``: the
        options' by default). Raises ``TimeoutError`` naming the ranks that did not call it within
        ``timeout`` seconds."""
        if self._levels is None:
            raise SaveRefusedError("latest() needs levels=[Level(...), ...] at construction")
        options = self.options.storage_options if storage_options is None else storage_options
        return self._levels.latest(options, verify, timeout)

    @overload
    def save(
        self, state: dict[str, Any], path: str | os.PathLike[str], *, extra_files: Mapping[str, bytes] | None = None
    ) -> DistributedSaveHandle: ...

    @overload
    def save(
        self, state: dict[str, Any], path: None = None, *, extra_files: Mapping[str, bytes] | None = None,
        step: int, due: Sequence[int] | None = None,
    ) -> SaveHandle: ...  # fmt: skip

    def save(
        self,
        state: dict[str, Any],
        path: str | os.PathLike[str] | None = None,
        *,
        extra_files: Mapping[str, bytes] | None = None,
        step: int | None = None,
        due: Sequence[int] | None = None,
    ) -> SaveHandle:
        """Start saving ``state`` (what ``torch.distributed.checkpoint.save`` takes) to the folder or
        URL ``path``; collective. Returns at once with a handle.

        ``step``: with ``levels=[...]`` at construction, ``save(state, step=n)`` (no path) saves to
        every level due at ``n`` (one DCP folder ``<level>/step-<n, 8 digits>`` each, per node for a
        node-local level) and returns one handle, done once each level has its copy on every rank.
        ``due``: the indices of the levels to save to instead of those with ``step % every == 0``
        (the same on every rank).

        ``extra_files``: small files (name -> bytes) that rank 0 of the group writes beside
        ``.metadata``, so they appear atomically with the checkpoint; ignored on other ranks. With
        ``step=``, they go into every level folder of the step (every node's, for a node-local level).

        Raises ``SaveRefusedError`` on every rank if planning fails on any (nothing written), or on
        this rank only if it cannot serialize its part (the save then fails on the others). An I/O
        error, even one met inside ``save()``, fails the save on every rank alike: the handle's
        ``wait()`` and the checkpointer's ``wait()`` / ``close()`` raise ``DistributedSaveError``.
        Unlike ``LazyCheckpointer.save``, it does not raise an earlier save's error (that would break
        the collective).
        """
        if path is None or step is not None or due is not None:
            if path is not None or step is None or self._levels is None:
                raise SaveRefusedError(
                    "save(state, path) takes no step= or due=; save(state, step=n) takes no path and needs "
                    "levels=[Level(...), ...] at construction"
                )
            return self._levels.save(state, step, due, extra_files)
        t0 = time.perf_counter()
        if self._closed:
            raise CheckpointerClosedError("this DistributedCheckpointer is closed; create a new one")
        # An earlier save's error is not raised here: a rank raising alone would leave the others
        # waiting in the planning collective. wait() and close() raise it.
        confirm_ready()  # earlier saves whose copies are over: this thread's ops came before
        final = resolve_path(path)
        url = _remote.is_url(final)
        n = self._next_n()
        part = LocalPart()
        completion = Completion(final, DistributedSaveHandle, url=final if url else None, part=part)
        handle: DistributedSaveHandle = completion.handle  # type: ignore[assignment]

        def prepare() -> str:  # coordinator, inside the planning collective
            if url:
                return ""  # no shared folder: every rank makes its own, on its node's disk
            if os.path.lexists(final) and not os.path.isdir(final):
                raise SaveRefusedError(f"{final} exists and is not a folder")
            if os.path.isdir(final) and os.listdir(final) and not os.path.exists(os.path.join(final, ".metadata")):
                raise SaveRefusedError(
                    f"{final} is a folder that holds no checkpoint (no .metadata); a save replaces the folder "
                    "at its path as a whole, so pass a path of its own (e.g. ckpt/step-100)"
                )
            parent = os.path.dirname(final)
            os.makedirs(parent, exist_ok=True)
            _commit.cleanup_leftovers(parent)
            staging = _commit.staging_path(final, self._token, n)
            os.mkdir(staging)
            return staging

        plan = plan_save(state, self._dist, final, prepare, self._plan_cache, n)
        entry = Save(n, final, plan.staging, handle, t0, metadata=plan.metadata, completion=completion, part=part)
        if self._dist.is_coordinator and extra_files:
            entry.extra_files = {extra_name(name): bytes(data) for name, data in extra_files.items()}
        with self._lock:
            self._pending.append(entry)
        try:
            if url:
                entry.remote = RemoteFolder.create(self._tier(), final)
                entry.staging = entry.remote.local
            self._start_file(entry, plan)
        except BaseException as exc:  # the other ranks must learn it: report it (the commit thread)
            exc = classify_start_error(exc, self.rank, final)
            entry.error = exc
            if not isinstance(exc, Exception) or isinstance(exc, SaveRefusedError):
                completion.caller_saw_error()  # raised here, not again by wait() or close()
                self._committer.submit(entry)
                raise exc
            # An I/O failure is the save's outcome, not a refusal: every rank raises it from wait().
        self._committer.submit(entry)
        return handle

    def wait(self, timeout: float | None = None) -> None:
        """Block until every save made so far is committed on every rank (or failed) and the
        levels' old checkpoints are removed; then raise the oldest error nobody has seen.
        ``TimeoutError`` if that takes over ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self._levels is not None:
            self._levels.drain(timeout)  # confirms this rank's files first
        for h in self._handles():
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h.wait_done(remaining):  # confirms this rank's file first
                raise TimeoutError(f"pending distributed saves not committed after {timeout} s")
        # the levels' retention deletions too; then the oldest unseen error (one ledger)
        self._inner.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def raise_errors(self) -> None:
        """Raise the oldest error of a finished save that nobody has seen, without waiting. Not
        collective: ranks learn of a failure at different moments, so callers that must raise on
        every rank at once agree first."""
        self._inner.raise_errors()

    def add_error(self, error: BaseException) -> None:
        """Hand over a background error of the caller's own, to be raised once by the next
        ``wait()`` or ``close()``."""
        self._inner.add_error(error)

    def wait_staged(self, timeout: float | None = None) -> None:
        """Block until this rank's pending host copies are done (its saved tensors may change)."""
        self._inner.wait_staged(timeout)

    def close(self) -> None:
        """Drain every pending save, stop the threads, free the buffers; raise any unseen error.
        Not collective, but every rank should close after its last save is committed."""
        if self._closed:
            return
        try:
            if self._levels is not None:
                self._levels.drain()
            for h in self._handles():
                h.wait_done()  # confirms this rank's file first
        finally:
            self._closed = True
            self._committer.stop()
            if self._levels is not None:
                self._levels.close()
            self._liveness.stop()
            _exit.unregister(self)
            _commit.discard_live(self._token)
            try:
                self._inner.close()  # raises the oldest unseen error (the inner checkpointer's ledger)
            finally:
                if dist.is_initialized():
                    dist.destroy_process_group(self._group)

    def _handles(self) -> list[DistributedSaveHandle]:
        with self._lock:
            return [s.handle for s in self._pending if s.handle is not None]

    def _next_n(self) -> int:
        """The next save's number, the same on every rank (they save in the same order)."""
        with self._lock:
            n, self._count = self._count, self._count + 1
        return n

    def _all_gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, value, group=self._group)
        return out

    # -- this rank's file ---------------------------------------------------------------------------

    def _tier(self) -> _remote.RemoteTier:
        """The inner checkpointer's remote tier, made by the first save to a URL; registers this
        checkpointer for the early exit drain (uploads need s3fs alive: ``core/exit.py``)."""
        _exit.register(self, _close_at_exit, layer=_exit.DISTRIBUTED, early=True)  # again: updates
        return producer_of(self._inner).remote_tier()

    def _start_file(self, entry: Save, plan: RankPlan) -> None:
        # To a URL, data files are named per save: a previous checkpoint at the prefix stays whole.
        unique = f".{self._token[:16]}-{entry.n}" if entry.remote is not None else ""
        entry.file = f"__{self.rank}_0{unique}.distcp"
        start_rank_file(self._inner, entry, plan)

    # -- the commit thread ------------------------------------------------------------------------

    def _commit_one(self, entry: Save) -> None:
        try:
            self._commit(entry)
        except BaseException as exc:  # a lost store or a bug: fail this save, go on
            host = self._store_host
            lost = isinstance(exc, (dist.DistError, OSError)) and host is not None and host != self.rank
            why = (
                f"coordinating the save failed on rank {self.rank} ({exc}); the folder holds the complete new "
                "checkpoint or was not replaced"
            ) + (f" (the store's host, rank {host}, died)" if lost else " (e.g. the store's host died)")
            try:
                self._finish(entry, save_error(entry.final, why, exc, (host,) if lost and host is not None else ()))
            except BaseException:  # noqa: BLE001 - the loop must outlive one save
                logger.exception("lazyckpt: finishing the distributed save to %s failed", entry.final)

    def _commit(self, entry: Save) -> None:
        remote = entry.remote
        report, own_error = self._own_report(entry)
        if remote is not None and report.ok:
            report, own_error = self._upload_own(entry, report)
        self._proto.post(entry.n, report)
        deadline = time.monotonic() + self.commit_timeout
        if self._dist.is_coordinator:
            outcome = self._decider.coordinate(entry, deadline)
        else:
            outcome = self._decider.follow(entry, deadline)
            self._proto.ack(entry.n)
        if remote is not None:
            if outcome is not None and outcome.undo:
                remote.remove_uploaded()
            remote.finish_local(keep=isinstance(own_error, UploadError))
        if outcome is None:
            self._finish(entry, None)
            return
        cause = outcome.cause or (own_error if own_error is not None and self.rank in outcome.ranks else None)
        self._finish(entry, save_error(entry.final, outcome.message, cause, outcome.ranks, outcome.upload))

    def _own_report(self, entry: Save) -> tuple[RankReport, BaseException | None]:
        """This rank's report, once its file is committed in the staging folder or failed (waits
        for the training thread to confirm it)."""
        exc = entry.error
        if exc is None and entry.local is not None and entry.layout is not None:
            exc = local_outcome(entry.local)
            if exc is None:
                layout = entry.layout
                return RankReport(self.rank, True, entry.file, layout.total_size, layout.file_crc, entry.storage), None
        if exc is None:  # save() neither failed nor started the file: cannot happen
            exc = RuntimeError(f"lazyckpt: rank {self.rank}'s file for {entry.final} was never started")
        return RankReport(self.rank, False, error=f"{type(exc).__name__}: {exc}"), exc

    # -- saves to URLs (``_upload.py``) -----------------------------------------------------------

    def _upload_own(self, entry: Save, report: RankReport) -> tuple[RankReport, BaseException | None]:
        """Upload this rank's durable file (a name of its own: nothing visible changes)."""
        remote = entry.remote
        assert remote is not None
        try:
            remote.upload(entry.file)
        except UploadError as exc:
            exc.local_path = remote.local
            return RankReport(self.rank, False, error=f"{type(exc).__name__}: {exc}", upload_failed=True), exc
        return report, None

    def _finish(self, entry: Save, error: BaseException | None) -> None:
        stats = None
        local = entry.local.stats if entry.local is not None else None
        if error is None and local is not None:
            stats = dataclasses.replace(local, path=entry.final, durable_s=time.perf_counter() - entry.t0)
            remote = entry.remote
            if remote is not None:
                gbps = remote.upload_bytes / remote.upload_s / 1e9 if remote.upload_s > 0 else 0.0
                stats = dataclasses.replace(stats, local_s=local.durable_s, upload_s=remote.upload_s, upload_gbps=gbps)
        with self._lock:  # a wait() that no longer finds the save pending finds its error
            if entry in self._pending:
                self._pending.remove(entry)
            assert entry.completion is not None
            resolved = resolve_handle(self._inner, entry.completion, stats, error)
        if resolved:
            complete_handle(self._inner, entry.completion)


def _close_at_exit(ckpt: DistributedCheckpointer) -> None:
    try:
        ckpt.close()
    except Exception as exc:  # nobody left to raise to
        logger.error("lazyckpt: a distributed checkpoint save failed before exit: %s", exc)
