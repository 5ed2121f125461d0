"""Multi-level distributed saves (``save(state, step=n)``): the DCP producer of one ``levels.Runner``,
which owns the schedule, level threads, pins, handles and retention. The caller thread plans and
starts this rank's one file into the fastest due level; that level's thread commits it on every rank
or none; each slower level's thread copies or uploads this rank's own file from there (``schedule.copy_checked``)
and commits. A level's failure is one ``DistributedLevelError`` per rank, alike on every rank.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch.distributed.checkpoint.utils import _DistWrapper

from lazyckpt.cluster import Scope, StoreExchange, dedup_groups, probe
from lazyckpt.core.handle import Completion, SaveHandle
from lazyckpt.core.remote import RemoteTier
from lazyckpt.core.report import Report
from lazyckpt.levels import Level, check_step
from lazyckpt.resume import Found, latest_agreed
from lazyckpt.schedule import Feed, Runner, check_file, check_levels, check_memory, copy_checked, not_due
from lazyckpt.storage import fs as _fs

from ..checkpointer import LazyCheckpointer, producer_of
from ..errors import CheckpointerClosedError, DistributedLevelError, SaveRefusedError, UploadError
from . import _commit
from ._commit import RankReport
from ._core import (
    classify_start_error,
    complete_handle,
    confirm_ready,
    local_outcome,
    renamed,
    resolve_handle,
    start_rank_file,
)
from ._decide import Decider
from ._handle import DistributedSaveHandle, Failure, LocalPart, Save, extra_name
from ._plan import PlanCache, plan_save
from ._replicas import replicate, replicator_of
from ._upload import RemoteFolder

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Context:
    """What the levels use of their ``DistributedCheckpointer`` (rank, token, store keys and
    ``commit_timeout``: the ``decider``'s)."""

    inner: LazyCheckpointer
    wrapper: _DistWrapper  # the planning collective, on the checkpointer's gloo group
    decider: Decider
    store: Any  # the c10d store (latest()'s exchange)
    next_n: Callable[[], int]  # the checkpointer's save counter (the same on every rank)
    all_gather: Callable[[Any], list[Any]]  # over the checkpointer's gloo group


@dataclass(eq=False)
class _Step:
    """One ``save(state, step=)`` on this rank."""

    n: int
    step: int
    first: int  # the fastest due level: the source
    entry: Save  # its folder: this rank's file and the source handle
    needs: frozenset[Any]  # every item this rank saved (its shard): what it loads back
    metadata: Any  # the global Metadata: each level folder's .metadata starts from a copy
    extra: dict[str, bytes] = field(default_factory=dict)  # rank 0: the extra files, into every level folder
    replicate: dict[int, tuple[str, str, int | None]] = field(default_factory=dict)  # committed: (folder, file, crc)


class DistributedLevels:
    """The multi-level saver of one ``DistributedCheckpointer``."""

    @staticmethod
    def check(levels: tuple[Any, ...]) -> None:
        """Refuse levels this saver cannot serve: ``TypeError`` unless a non-empty list of ``Level``;
        ``ValueError`` for two levels at one path, or a URL level without a faster local level due
        whenever it is."""
        check_levels(levels)
        if len({lv.path for lv in levels}) != len(levels):
            raise ValueError("two levels share a path; give each level its own folder")
        for i, level in enumerate(levels):
            if level.is_url and not any(not lv.is_url and level.every % lv.every == 0 for lv in levels[:i]):
                raise ValueError(
                    f"level {i} ({level.path}) is a URL: give a faster local level whose every divides its every "
                    f"({level.every}), so that a local copy exists to upload whenever it is due"
                )

    def __init__(self, ctx: Context, levels: tuple[Level, ...]) -> None:
        self.check(levels)
        self.ctx = ctx
        self.rank, self.world = ctx.decider.rank, ctx.decider.world_size
        self.levels = levels
        self.options = ctx.inner.options
        self.scopes: list[Scope] = probe(levels, ctx.decider.token, self.rank, ctx.decider.world_size, ctx.all_gather)
        self._groups = dedup_groups(self.scopes, self.world)
        self.replicator = replicator_of(levels, self.scopes, self.rank, ctx.wrapper.group, ctx.decider.commit_timeout,
                                        self.options.fsync)  # fmt: skip
        for level, scope in zip(levels, self.scopes, strict=True):
            if not level.is_url and self.rank == scope.leader:  # dead saves' staging folders, copies
                _commit.cleanup_leftovers(level.path)
                _fs.cleanup_temporaries(level.path)
        self.runner = Runner(
            levels, self, self.options.storage_options, folder=True, name="lazyckpt-dist-level", owns=self._leads
        )
        self._plans = PlanCache()
        self._latest_calls = 0
        self._memory_checked = False
        self._closed = False

    def _replicate(self, index: int, st: _Step) -> None:
        """Level ``index``'s part of ``st`` ended: hand its commit to the replicator, else cancel
        the replicator's expectation."""
        assert self.replicator is not None
        committed = st.replicate.pop(index, None)
        try:
            if committed is not None:
                replicate(self.replicator, index, st.step, *committed, self._leads(index))
                return
        except Exception:  # noqa: BLE001 - a bug: this step is not replicated, drain() still ends
            logger.exception("lazyckpt: step %d could not be handed to the replicator", st.step)
        self.replicator.cancel()

    def _leads(self, index: int) -> bool:
        return self.rank == self.scopes[index].leader

    @property
    def has_urls(self) -> bool:
        return any(lv.is_url for lv in self.levels)

    # -- caller side ------------------------------------------------------------------------------

    def save(
        self,
        state: dict[str, Any],
        step: int,
        due: Sequence[int] | None = None,
        extra_files: Mapping[str, bytes] | None = None,
    ) -> SaveHandle:
        """Collective: ``DistributedCheckpointer.save(state, step=...)``."""
        step = check_step(step)
        if self._closed:
            raise CheckpointerClosedError("this DistributedCheckpointer is closed; create a new one")
        t0 = time.perf_counter()
        runner = self.runner
        due = runner.due(step, due)
        if not due:
            return not_due(step, t0)
        confirm_ready()  # earlier saves whose copies are over: this thread's ops came before
        ctx, first = self.ctx, due[0]
        n = ctx.next_n()
        key = f"{n}-{first}"
        final = self.levels[first].folder(step)
        plan = plan_save(state, ctx.wrapper, final, lambda: "", self._plans, n, groups=self._groups)
        # all admitted ("block" only); at the bound, this rank's pending files are confirmed first
        admitted = [i for i in due[1:] if runner.admit(i, step, None, ctx.inner.wait_staged)]
        part = LocalPart()
        completion = Completion(final, DistributedSaveHandle, part=part)
        handle: DistributedSaveHandle = completion.handle  # type: ignore[assignment]
        staging = _commit.staging_path(final, ctx.decider.token, key)
        entry = Save(
            key, final, staging, handle, t0, metadata=copy.copy(plan.metadata), completion=completion, part=part
        )
        entry.file = f"__{self.rank}_0.distcp"
        st = _Step(n, step, first, entry, plan.needs, plan.metadata)
        feed = runner.begin(step, first, final, admitted, pin_save=False, context=st)  # pinned once per copy
        levels_handle = runner.parts(feed, handle, final, [first, *admitted], t0)
        runner.sweep_once()
        refused: BaseException | None = None
        try:
            if self.rank == 0 and extra_files:  # a bad name fails the save on every rank, not here alone
                st.extra = entry.extra_files = {extra_name(k): bytes(v) for k, v in extra_files.items()}
            os.makedirs(staging, exist_ok=True)
            start_rank_file(ctx.inner, entry, plan)
        except BaseException as exc:  # every rank must learn it: reported by the level thread
            entry.error = classify_start_error(exc, self.rank, final)
            if not isinstance(entry.error, Exception) or isinstance(entry.error, SaveRefusedError):
                completion.caller_saw_error()  # raised here, not again by wait() or close()
                refused = entry.error
        for i in [first, *admitted]:
            if self.replicator is not None and i in self.replicator.rings:
                self.replicator.expect()
        if not runner.submit(first, st):  # the source commit, on the fastest level's thread; none: closed
            self._finish_source(entry, CheckpointerClosedError("lazyckpt: the level threads are stopped"))
            self.ended(first, None, st)
        runner.start(feed, admitted, unpin_save=False)
        if refused is not None:
            raise refused
        self._check_memory(entry)
        return levels_handle

    def latest(self, storage_options: dict[str, Any] | None, verify: bool, timeout: float) -> Found | None:
        """Collective: ``lazyckpt.latest`` agreed through the store."""
        prefix = f"lazyckpt/{self.ctx.decider.token}/latest/{self._latest_calls}"
        self._latest_calls += 1
        exchange = StoreExchange(self.ctx.store, prefix, self.rank, self.world, timeout)
        group = None if self.replicator is None else self.replicator.group
        return latest_agreed(
            self.levels, exchange, storage_options, verify, scopes=self.scopes, replication_group=group
        )

    def drain(self, timeout: float | None = None) -> None:
        """Wait for every multi-level save (confirming this rank's files on this thread)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        self.runner.drain(timeout)
        if self.replicator is not None:  # bounded: each round by the replication group's timeout
            self.replicator.drain(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Stop the level threads (after ``drain``) and the callback thread."""
        if self._closed:
            return
        self._closed = True
        self.runner.close()
        if self.replicator is not None:
            self.replicator.close()

    # -- the runner's producer (``levels.LevelProducer``) ---------------------------------------------

    def run(self, st: _Step) -> None:
        """The source commit of one save, on the fastest due level's thread."""
        try:
            self._commit_source(st)
        except BaseException as exc:  # noqa: BLE001 - a bug: the handle must still end
            logger.exception("lazyckpt: level %d of step %d failed unexpectedly", st.first, st.step)
            self._finish_source(st.entry, exc)
        finally:
            self.ended(st.first, None, st)

    def promote(self, index: int, feed: Feed) -> DistributedLevelError | None:
        """A slower level's copy of this rank's file, once the source committed (on every rank alike)."""
        st: _Step = feed.context
        error = self._copy_and_commit(index, st)
        if error is None and st.entry.layout is not None:
            st.replicate[index] = (self.levels[index].folder(st.step), st.entry.file, st.entry.layout.file_crc)
        return error

    def ended(self, index: int, feed: Feed | None, st: _Step | None = None) -> None:
        """Level ``index``'s part of a save ended: its replication (a replicated level) settled."""
        if self.replicator is not None and index in self.replicator.rings:
            self._replicate(index, st if st is not None else feed.context)  # type: ignore[union-attr]

    def discard(self, path: str) -> None:  # pragma: no cover - the source is always a local level's folder
        pass

    def publish(self, report: Report) -> None:
        producer_of(self.ctx.inner).publish(report)  # one ledger: wait() / close() raise it once

    def remove(self, path: str) -> Any:
        return self.ctx.inner.remove(path)

    def remote_tier(self) -> RemoteTier:
        return producer_of(self.ctx.inner).remote_tier()

    def reuse(self, index: int) -> None:
        return None  # not for distributed levels (Level.reuse_pages)

    def _commit_source(self, st: _Step) -> None:
        """The fastest level's folder: wait for this rank's file (or its failure), then commit."""
        entry = st.entry
        own = entry.error
        if own is None and entry.local is not None and entry.layout is not None:
            own = local_outcome(entry.local)  # waits WITHOUT confirming: the training thread does
        if own is None and entry.layout is not None:
            report = self._report(st.first, entry, entry.layout, entry.storage, st.needs)
        else:
            own = own or RuntimeError(f"lazyckpt: rank {self.rank}'s file for {entry.final} was never started")
            report = RankReport(self.rank, False, error=f"{type(own).__name__}: {own}")
        outcome = self._commit(st.first, entry, report)
        self._finish_source(entry, None if outcome is None else self._error(st.first, st.step, entry, outcome, own))
        if outcome is None and entry.layout is not None:
            st.replicate[st.first] = (entry.final, entry.file, entry.layout.file_crc)

    def _copy_and_commit(self, index: int, st: _Step) -> DistributedLevelError | None:
        ctx, level, source = self.ctx, self.levels[index], st.entry
        assert source.layout is not None
        key = f"{st.n}-{index}"
        entry = Save(key, level.folder(st.step), "", None, st.entry.t0, metadata=copy.copy(st.metadata))
        entry.extra_files = st.extra
        src = os.path.join(self.levels[st.first].folder(st.step), source.file)
        own: BaseException | None = None
        try:
            if level.is_url:
                entry.remote = RemoteFolder.create(producer_of(ctx.inner).remote_tier(), entry.final)
                entry.staging = entry.remote.local  # the coordinator's .metadata and manifest
                name = f"__{self.rank}_0.{ctx.decider.token[:16]}-{key}.distcp"  # a name of its own per save
                check_file(src, source.layout.file_crc)
                entry.remote.upload_from(name, src)
                storage = renamed(source.storage, name)
            else:
                entry.staging = _commit.staging_path(entry.final, ctx.decider.token, key)
                name, storage = source.file, source.storage
                copy_checked(src, entry.staging, name, source.layout.file_crc, self.options.fsync)
            entry.file = name
            report = self._report(index, entry, source.layout, storage, st.needs)
        except Exception as exc:  # reported: the save fails at this level on every rank
            own = exc
            report = RankReport(self.rank, False, error=f"{type(exc).__name__}: {exc}",
                                upload_failed=isinstance(exc, UploadError))  # fmt: skip
        outcome = self._commit(index, entry, report)
        if entry.remote is not None:
            if outcome is not None and outcome.undo:
                entry.remote.remove_uploaded()
            shutil.rmtree(os.path.dirname(entry.remote.local), ignore_errors=True)
        return None if outcome is None else self._error(index, st.step, entry, outcome, own)

    def _report(
        self, index: int, entry: Save, layout: Any, storage: dict[Any, Any], needs: frozenset[Any]
    ) -> RankReport:
        """This rank's durable file in level ``index``'s folder; rank 0's carries the extra files
        for a node-local level."""
        extra = entry.extra_files if self.scopes[index].node_local and self.rank == 0 and entry.extra_files else None
        return RankReport(self.rank, True, entry.file, layout.total_size, layout.file_crc, storage, needs=needs,
                          extra_files=extra)  # fmt: skip

    def _commit(self, index: int, entry: Save, report: RankReport) -> Failure | None:
        """One level folder's two-phase commit, this rank's side; None when committed."""
        ctx, scope = self.ctx, self.scopes[index]
        ctx.decider.proto.post(entry.n, report)
        deadline = time.monotonic() + ctx.decider.commit_timeout
        if scope.node_local:
            return ctx.decider.commit_node(entry, deadline, scope)
        if self.rank == 0:
            return ctx.decider.coordinate(entry, deadline)
        outcome = ctx.decider.follow(entry, deadline)
        ctx.decider.proto.ack(entry.n)
        return outcome

    def _error(
        self, index: int, step: int, entry: Save, outcome: Failure, own: BaseException | None
    ) -> DistributedLevelError:
        level = self.levels[index]
        cause = outcome.cause or (own if own is not None and self.rank in outcome.ranks else None)
        code = getattr(cause, "errno", None)
        err = DistributedLevelError(
            f"lazyckpt: level {index} ({level.path}), step {step}: {outcome.message}",
            index, level.path, step, entry.final, errno=code if isinstance(code, int) else None, ranks=outcome.ranks,
        )  # fmt: skip
        err.__cause__ = cause
        return err

    def _finish_source(self, entry: Save, error: BaseException | None) -> None:
        stats = None
        local = entry.local.stats if entry.local is not None else None
        if error is None and local is not None:
            stats = dataclasses.replace(local, path=entry.final, durable_s=time.perf_counter() - entry.t0)
        assert entry.completion is not None
        if resolve_handle(self.ctx.inner, entry.completion, stats, error):
            complete_handle(self.ctx.inner, entry.completion)

    def _check_memory(self, entry: Save) -> None:
        """First save only: ``check_memory`` with this rank's file size times the ranks sharing the
        largest local level folder."""
        if self._memory_checked or entry.layout is None:
            return
        self._memory_checked = True
        local = [s for lv, s in zip(self.levels, self.scopes, strict=True) if not lv.is_url]
        sharing = max((len(s.group) for s in local), default=1)
        check_memory(self.levels, entry.layout.total_size * sharing)
