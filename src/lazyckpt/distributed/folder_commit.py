"""The two-phase commit of a folder whose files every rank writes itself (no DCP metadata): DeepSpeed's tags.

``FolderCommit`` is one job-wide participant per rank (made on every rank in the same order): a token agreed
through the c10d store, a heartbeat thread, and ``commit()``: post this rank's outcome, then the decision of
``_decide.Decider`` (rank 0 renames the staging folder into place once every rank reported its files
durable, then runs ``after_publish``; a failure, a dead rank or ``commit_timeout`` aborts on every rank). A
node-local folder (``scope``): the same decision, each node's leader renaming its node's folder.
``commit()`` blocks (bounded): call it from a background thread, never from one a peer waits on.
"""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import Callable
from typing import Any

from lazyckpt.cluster import Scope, StoreExchange

from ..errors import DistributedSaveError
from . import _commit
from ._decide import Decider
from ._handle import Save, save_error

_made = itertools.count()  # FolderCommits made in this process: every rank makes them in the same order


class FolderCommit:
    """One rank's side of the folder commits of one owner (an engine); ``close()`` ends its heartbeat."""

    def __init__(self, rank: int, world_size: int, commit_timeout: float, fsync: bool) -> None:
        self.rank, self.world_size, self.commit_timeout = rank, world_size, float(commit_timeout)
        store = StoreExchange.default_store()
        key = f"lazyckpt/folder-commit/token/{next(_made)}"
        if rank == 0:
            store.set(key, uuid.uuid4().hex)
        store.wait([key])
        self.token = bytes(store.get(key)).decode()
        _commit.add_live(self.token)
        self._proto = _commit.StoreProtocol(store, self.token, rank, world_size)
        self._liveness = _commit.Liveness(store, self.token, rank, world_size)
        self._liveness.start("lazyckpt-folder-heartbeat")
        self._decider = Decider(self._proto, self._liveness, rank, world_size, self.commit_timeout, self.token, fsync)
        self._store = store
        self._exchanges: dict[str, StoreExchange] = {}

    def staging(self, final: str, n: int) -> str:
        """The hidden staging folder of commit ``n`` beside ``final`` (the same on every rank)."""
        return _commit.staging_path(final, self.token, n)

    def cleanup_leftovers(self, directory: str) -> None:
        """Staging folders of dead jobs in ``directory`` (not this job's: its token is live)."""
        _commit.cleanup_leftovers(directory)

    def commit(
        self,
        n: int,
        final: str,
        own_error: BaseException | None,
        after_publish: Callable[[], None] | None = None,
        scope: Scope | None = None,
    ) -> DistributedSaveError | None:
        """This rank's part of commit ``n`` (its files in ``staging(final, n)`` durable, or ``own_error``); None
        once the folder is at ``final`` (and its owner's ``after_publish`` ran), else the error every rank gets.
        ``scope`` node-local: one decision by rank 0, then each node's leader renames its node's folder and runs
        ``after_publish`` (``Decider.commit_node``); else rank 0 owns the one folder."""
        entry = Save(n, final, self.staging(final, n), None, time.perf_counter(), after_publish=after_publish)
        why = "" if own_error is None else f"{type(own_error).__name__}: {own_error}"
        try:
            self._proto.post(n, _commit.RankReport(self.rank, own_error is None, error=why))
            deadline = time.monotonic() + self.commit_timeout
            if scope is not None and scope.node_local:
                outcome = self._decider.commit_node(entry, deadline, scope)
            elif self.rank == 0:
                outcome = self._decider.coordinate(entry, deadline)
            else:
                outcome = self._decider.follow(entry, deadline)
                self._proto.ack(n)
        except Exception as exc:  # a lost store: this commit fails, the next may work
            return save_error(final, f"coordinating the save failed on rank {self.rank}: {exc}", exc)
        if outcome is None:
            return None
        return save_error(final, outcome.message, own_error or outcome.cause, outcome.ranks)

    def all_gather(self, value: Any, channel: str = "") -> list[Any]:
        """Collective (every rank, in the same order per ``channel``: one thread's calls each): every rank's
        small JSON ``value``; ``RuntimeError`` soon after a rank dies (its heartbeat), ``TimeoutError`` after
        ``commit_timeout``."""
        exchange = self._exchanges.get(channel)
        if exchange is None:  # (one thread per channel: no race on its entry)
            exchange = self._exchanges[channel] = StoreExchange(
                self._store, f"lazyckpt/folder-commit/{self.token}/gather/{channel}", self.rank, self.world_size,
                self.commit_timeout,
            )  # fmt: skip
        return exchange.all_gather(value, dead=self._liveness.dead)

    def close(self) -> None:
        self._liveness.stop()
        _commit.discard_live(self.token)
