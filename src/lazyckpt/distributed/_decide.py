"""The two-phase commit's decisions as one rank takes part in them, on ``DistributedCheckpointer``'s
commit thread (or a level thread): ``coordinate`` on the coordinator, ``follow`` on the others,
``commit_node`` for a node-local level. ``None`` means committed, else a ``Failure``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch.distributed as dist

from lazyckpt.cluster import Scope
from lazyckpt.storage import fs as _fs

from ..errors import NotDurableError, UploadError
from . import _commit
from ._commit import COMMIT, CommitResult, Decision, Liveness, RankReport, StoreProtocol
from ._handle import Failure
from ._handle import Save as _Save

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Decider:
    """One checkpointer's side of the protocol: its store keys, heartbeat view, rank and bounds."""

    proto: StoreProtocol
    liveness: Liveness
    rank: int
    world_size: int
    commit_timeout: float
    token: str
    fsync: bool

    def upload_metadata_files(self, entry: _Save) -> None:
        """Coordinator, every rank's file uploaded: the extra files (hiding a previous checkpoint
        first) and the manifest; ``.metadata`` follows after the decision."""
        remote = entry.remote
        assert remote is not None
        if entry.extra_files:
            remote.hide_previous()
        for name in entry.extra_files:
            remote.upload(name)
        remote.upload(_commit.MANIFEST)

    def commit_remote(self, entry: _Save, reports: dict[int, RankReport]) -> Failure | None:
        """Coordinator, after deciding commit: upload ``.metadata`` (the commit point), then delete
        the previous checkpoint's data files (best effort) and post the result."""
        remote = entry.remote
        assert remote is not None
        try:
            remote.upload(_commit.METADATA)
        except UploadError as exc:
            remote.remove_uploaded()  # .metadata first (the failed PUT may have landed), before the others learn
            why = f"nothing was committed; rank {self.rank} (coordinator) could not upload .metadata: {exc}"
            self.proto.set_result(entry.n, CommitResult(False, why))
            return Failure(why, (self.rank,), upload=True, cause=exc)
        remote.remove_stale({r.file for r in reports.values()})
        remote.abort_unfinished()  # before the result: then the others may start their next save
        self.proto.set_result(entry.n, CommitResult(True))
        return None

    # -- the commit -------------------------------------------------------------------------------

    def coordinate(self, entry: _Save, deadline: float) -> Failure | None:
        """Coordinator: gather, write the metadata, decide, publish. None when committed."""
        reports, missing, dead = self.proto.gather(entry.n, deadline, self.liveness)
        own_exc: Exception | None = None
        abort = self._abort_for(reports, missing, dead)
        if abort is not None:
            if entry.remote is not None:  # before the decision: then the others may start their next save
                entry.remote.abort_unfinished()
            decided = self.proto.decide(entry.n, abort)
        else:
            try:
                if entry.metadata is not None:  # a DCP folder (a folder of plain rank files has none)
                    save_id = f"{self.token}-{entry.n}"
                    _commit.write_metadata(
                        entry.staging, entry.final, save_id, entry.metadata, reports, self.fsync, entry.extra_files
                    )
                if entry.remote is not None:
                    self.upload_metadata_files(entry)
            except Exception as exc:
                own_exc = exc
                if entry.remote is not None:  # shared keys touched: clean up before the others move on
                    entry.remote.remove_uploaded()
                why = f"rank {self.rank} (coordinator): writing the metadata failed: {exc}"
                decided = self.proto.decide(entry.n, Decision.abort(why, [self.rank], isinstance(exc, UploadError)))
            else:
                decided = self.proto.decide(entry.n, COMMIT)
        outcome: Failure | None = None
        if not decided.commit:
            if entry.remote is None:
                shutil.rmtree(entry.staging, ignore_errors=True)
            outcome = _abort_reason(decided)
            outcome.cause = own_exc
        elif entry.remote is not None:
            outcome = self.commit_remote(entry, reports)
        else:
            try:
                old = _commit.staging_path(entry.final, self.token, entry.n, old=True)
                _fs.swap_in(entry.staging, entry.final, old, self.fsync)
            except OSError as exc:
                if isinstance(exc, NotDurableError):
                    why = f"rank {self.rank} (coordinator): {exc}"
                else:
                    shutil.rmtree(entry.staging, ignore_errors=True)
                    why = f"nothing was committed; rank {self.rank} (coordinator) could not publish the folder: {exc}"
                self.proto.set_result(entry.n, CommitResult(False, why))
                outcome = Failure(why, (self.rank,), cause=exc)
            else:
                outcome = self._after_publish(entry)
                self.proto.set_result(
                    entry.n, CommitResult(True) if outcome is None else CommitResult(False, outcome.message)
                )
        # Ranks that never reported may be slow and still need the outcome: keys stay unless all acked.
        others = [r for r in range(self.world_size) if r != self.rank and r not in missing]
        acked = self.proto.wait_acks(entry.n, others, time.monotonic() + self.commit_timeout, self.liveness)
        if acked and not missing:
            self.proto.drop(entry.n)
        elif not acked:
            logger.warning("lazyckpt: not every rank acknowledged the end of the save to %s", entry.final)
        return outcome

    def _after_publish(self, entry: _Save) -> Failure | None:
        """The folder's owner (the coordinator, a node's leader), the folder in place: ``entry.after_publish``
        (DeepSpeed's ``latest``)."""
        if entry.after_publish is None:
            return None
        try:
            entry.after_publish()
        except Exception as exc:
            why = f"rank {self.rank}: {entry.final} is in place, but what follows failed: {exc}"
            return Failure(why, (self.rank,), undo=False, cause=exc)
        return None

    def _abort_for(self, reports: dict[int, RankReport], missing: list[int], dead: list[int]) -> Decision | None:
        """The coordinator's abort when a rank failed, died or never reported; None: commit."""
        failed = sorted(r.rank for r in reports.values() if not r.ok)
        if not failed and not missing:
            return None
        why = "; ".join(f"rank {r}: {reports[r].error}" for r in failed)
        if dead:
            why = (why + "; " if why else "") + (
                f"rank(s) {dead} died or vanished (no heartbeat in the store for {_commit.DEAD_AFTER_S} s) "
                "before reporting a durable file"
            )
        elif missing:
            why = (why + "; " if why else "") + (
                f"rank(s) {missing} did not report a durable file within {self.commit_timeout} s "
                "(hung, or slower than commit_timeout)"
            )
        upload = any(reports[r].upload_failed for r in failed)
        return Decision.abort(why, failed + (dead or missing), upload)

    def follow(self, entry: _Save, deadline: float) -> Failure | None:
        """Other ranks: wait for the coordinator's decision (or decide abort when it never comes)."""
        decided = self._await_decision(entry, deadline)
        if not decided.commit:
            self._discard_own(entry)
            return _abort_reason(decided)
        result = self.proto.wait_result(entry.n, time.monotonic() + self.commit_timeout, self.liveness)
        if result is not None and result.ok:
            return None
        if result is None:
            died = self.liveness.dead([0])
            when = "died before confirming" if died else f"did not confirm within {self.commit_timeout} s"
            return Failure(
                f"the coordinator (rank 0) decided to commit but {when}; "
                f"{entry.final} holds either the complete new checkpoint or the previous state",
                (0,),
                undo=False,
            )
        # To a URL, publishing is uploading .metadata: its failure is an upload failure.
        return Failure(result.why, (0,), upload=entry.remote is not None)

    @staticmethod
    def _discard_own(entry: _Save) -> None:
        """An aborted save, on a rank that does not own the folder: remove its own file from the
        staging folder, and the folder if empty (a slow rank may have renamed its file in late)."""
        if entry.remote is not None or not entry.staging:
            return
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(entry.staging, entry.file))
        with contextlib.suppress(OSError):
            os.rmdir(entry.staging)

    def _await_decision(self, entry: _Save, deadline: float) -> Decision:
        """A follower: the coordinator's decision, or its own abort when none comes in time."""
        decided = self.proto.wait_decision(entry.n, deadline, self.liveness)
        if decided is None:
            if self.liveness.dead([0]):
                why = (
                    "rank 0 (the coordinator) died or vanished (no heartbeat in the store for "
                    f"{_commit.DEAD_AFTER_S} s) before deciding"
                )
                ranks = [0]
            else:
                why = (
                    f"rank {self.rank} got no decision from the coordinator within {self.commit_timeout} s "
                    "after its own file was durable (a rank hung, or is slower than commit_timeout)"
                )
                ranks = []
            decided = self.proto.decide(entry.n, Decision.abort(why, ranks))
        return decided

    # -- node-local levels: one folder per node, one decision for all -----------------------------

    def commit_node(self, entry: _Save, deadline: float, scope: Scope) -> Failure | None:
        """A node-local level's folder of one step, on every rank. Rank 0 decides for every node at
        once; then each node's leader writes its folder's metadata and rank 0's extra files and
        renames it into place. Every rank waits for every leader's result, so all learn the same
        outcome; a failed node lacks the folder, the others keep theirs. A folder of rank files (no
        metadata: DeepSpeed's) has a second round: once every node's folder is in place, each leader
        runs ``after_publish`` (its ``latest``, its retention), and every rank waits for those too."""
        missing: list[int] = []
        if self.rank == 0:
            reports, missing, dead = self.proto.gather(entry.n, deadline, self.liveness)
            decided = self.proto.decide(entry.n, self._abort_for(reports, missing, dead) or COMMIT)
        else:
            decided = self._await_decision(entry, deadline)
        outcome: Failure | None
        if not decided.commit:
            if self.rank == scope.leader:
                shutil.rmtree(entry.staging, ignore_errors=True)
            else:
                self._discard_own(entry)
            outcome = _abort_reason(decided)
        else:
            if self.rank == scope.leader:
                self.proto.set_value(entry.n, _node_result(scope.leader), self._publish_node(entry, scope).encode())
            outcome = self._node_results(entry, scope)
            if entry.metadata is None:  # (alike on every rank) never a latest naming a tag some node lacks
                if self.rank == scope.leader:
                    failure = self._after_publish(entry) if outcome is None else None
                    done = CommitResult(True) if failure is None else CommitResult(False, failure.message)
                    self.proto.set_value(entry.n, _after_result(scope.leader), done.encode())
                outcome = outcome or self._node_results(entry, scope, _after_result)
        if self.rank != 0:
            self.proto.ack(entry.n)
            return outcome
        others = [r for r in range(1, self.world_size) if r not in missing]
        acked = self.proto.wait_acks(entry.n, others, time.monotonic() + self.commit_timeout, self.liveness)
        if acked and not missing:
            keys = [_node_result(g[0]) for g in scope.groups]
            if entry.metadata is None:
                keys += [_after_result(g[0]) for g in scope.groups]
            self.proto.drop(entry.n, tuple(keys))
        return outcome

    def _publish_node(self, entry: _Save, scope: Scope) -> CommitResult:
        """A node's leader: a DCP folder's metadata and rank 0's extra files, then the rename."""
        try:
            if entry.metadata is not None:  # a DCP folder (a folder of plain rank files has none)
                reports = self.proto.reports(entry.n, scope.group)
                # The extra files are rank 0's: other leaders read them from its report.
                extra = entry.extra_files if self.rank == 0 else self.proto.reports(entry.n, [0])[0].extra_files
                save_id = f"{self.token}-{entry.n}"
                _commit.write_metadata(
                    entry.staging, entry.final, save_id, copy.copy(entry.metadata), reports, self.fsync, extra,
                    world_size=self.world_size,
                )  # fmt: skip
            old = _commit.staging_path(entry.final, self.token, entry.n, old=True)
            _fs.swap_in(entry.staging, entry.final, old, self.fsync)
        except Exception as exc:  # noqa: BLE001 - every rank must learn it
            if not isinstance(exc, NotDurableError):
                shutil.rmtree(entry.staging, ignore_errors=True)
            return CommitResult(False, f"rank {self.rank} could not publish its node's folder {entry.final}: {exc}")
        return CommitResult(True)

    def _node_results(self, entry: _Save, scope: Scope, key: Callable[[int], str] | None = None) -> Failure | None:
        failures: list[tuple[int, str]] = []
        for leader in sorted(g[0] for g in scope.groups):
            raw = self.proto.wait_value(
                entry.n, (key or _node_result)(leader), time.monotonic() + self.commit_timeout, self.liveness, leader
            )
            if raw is None:
                died = self.liveness.dead([leader])
                failures.append((leader, "died before confirming" if died else "did not confirm in time"))
            elif not (result := CommitResult.decode(raw)).ok:
                failures.append((leader, result.why))
        if not failures:
            return None
        why = "; ".join(f"the node of rank {leader}: {what}" for leader, what in failures)
        return Failure(f"not committed on every node ({why})", tuple(r for r, _ in failures), undo=False)


def _abort_reason(decided: Decision) -> Failure:
    return Failure("nothing was committed; " + decided.why, decided.ranks, upload=decided.upload)


def _node_result(leader: int) -> str:
    return f"result-g{leader}"


def _after_result(leader: int) -> str:
    return f"after-g{leader}"


def store_host_rank(group: dist.ProcessGroup, rank: int) -> int | None:
    """The rank (in ``group``) whose process hosts the c10d store: global rank 0, or None under
    torchrun, whose agent hosts it."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        return None
    ranks = dist.get_process_group_ranks(group)
    return ranks.index(0) if 0 in ranks else None
