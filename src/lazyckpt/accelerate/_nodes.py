"""Levels in a job of several nodes: who shares each level's folder; a process outside the main process's
node-local folder saves into its own staging folder and posts its RNG file through the c10d store, which the
main process writes into its folder. Non-main processes beat in the store (``lazyckpt-heartbeat`` thread).
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Sequence

from accelerate.utils.constants import RNG_STATE_NAME

from lazyckpt.cluster import Scope, StoreExchange, probe
from lazyckpt.commit.folder import marker_name
from lazyckpt.distributed import DEAD_AFTER_S, Liveness
from lazyckpt.levels import Level
from lazyckpt.storage import fs as _fs

_OK, _ERR = b"\x00", b"\x01"


class Nodes:
    """The levels' scopes in a job of several processes, and the RNG files' exchange.

    Constructed collectively at install; raises ``ValueError`` for a node-local level without ``replicas``.
    """

    def __init__(self, levels: Sequence[Level], rank: int, world: int, timeout: float) -> None:
        exchange = StoreExchange.default(timeout)
        token = str(exchange.all_gather(uuid.uuid4().hex if rank == 0 else None)[0])
        self.scopes: list[Scope] = probe(list(levels), token, rank, world, exchange.all_gather)
        for i, (level, scope) in enumerate(zip(levels, self.scopes, strict=True)):
            if scope.node_local and not level.replicas:
                raise ValueError(
                    f"level {i} ({level.path}): the folder of one node's processes only (the probe found "
                    f"{[list(g) for g in scope.groups]}) and replicas=0: the main process writes each step's folder "
                    "on its node, and the other nodes could not resume from it. Give it replicas=1 (copies in "
                    "other nodes' memory; lazyckpt.accelerate.load_latest gives every node the newest step) or "
                    "use a folder every process shares"
                )
        for level in levels:  # leftovers of a killed process on this host
            if not level.is_url:
                _fs.cleanup_temporaries(level.path)
        self.rank, self.world = rank, world
        self.store = StoreExchange.default_store()
        self.prefix = f"lazyckpt/accelerate/{token[:16]}"
        self._seq = 0
        self._read: dict[int, int] = {}  # save -> answers read so far (the main process)
        # another node's dead process leaves no marker the main process can see: heartbeats instead
        self._liveness: Liveness | None = None
        if any(scope.node_local for scope in self.scopes):
            self._liveness = Liveness(self.store, f"accelerate-{token[:16]}", rank, world)
            if rank != 0:
                self._liveness.start("lazyckpt-heartbeat")

    def next_seq(self) -> int:
        """The number of this bare save with a due level (alike on every process)."""
        self._seq += 1
        return self._seq

    def outside(self, index: int) -> list[int]:
        """The processes that do not see the main process's folder of level ``index``."""
        return [r for g in self.scopes[index].groups if 0 not in g for r in g]

    why_dead = f"no heartbeat in the store for {DEAD_AFTER_S:g} s"

    def dead(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` whose heartbeat stopped (the main process)."""
        return self._liveness.dead(ranks) if self._liveness is not None else []

    def close(self) -> None:
        if self._liveness is not None:
            self._liveness.stop()

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.prefix}/{seq}/{rank}"

    def _count(self, seq: int) -> str:
        return f"{self.prefix}/{seq}/answers"

    # -- a process outside the main process's folder --------------------------------------------------

    def post(self, seq: int, staging: str, error: BaseException | None) -> None:
        """Post this process's RNG file of save ``seq`` (in ``staging``), or ``error``, to the main process;
        ``staging`` is removed."""
        try:
            if error is None:
                with open(os.path.join(staging, f"{RNG_STATE_NAME}_{self.rank}.pkl"), "rb") as fh:
                    value = _OK + fh.read()
            else:
                value = _ERR + f"{type(error).__name__}: {error}".encode()
        except OSError as exc:
            value = _ERR + f"cannot read its RNG file: {exc}".encode()
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self.store.set(self._key(seq, self.rank), value)
        self.store.add(self._count(seq), 1)  # after the value: a counted answer has its key

    # -- the main process -----------------------------------------------------------------------------

    @staticmethod
    def available() -> bool:
        """Whether the job has the default c10d store this needs (not with the MPI backend)."""
        try:
            return StoreExchange.default_store() is not None
        except Exception:  # noqa: BLE001 - a torch without it, or no process group
            return False

    @staticmethod
    def hold(folder: str) -> str:
        """Create the main process's marker in ``folder``: incomplete until ``release`` (a dead main process
        leaves it, so the folder is never chosen)."""
        os.makedirs(folder, exist_ok=True)
        marker = os.path.join(folder, marker_name("gather"))
        with open(marker, "w") as fh:
            fh.write("lazyckpt: the main process's save into this folder has not ended (every process's part)\n")
        return marker

    @staticmethod
    def release(marker: str) -> None:
        try:
            os.unlink(marker)
        except FileNotFoundError:
            pass

    def collect(self, seq: int, folder: str, ranks: list[int], fsync: bool) -> tuple[list[int], list[str]]:
        """Write the RNG file of each of ``ranks`` whose answer to save ``seq`` arrived into ``folder``
        (temporary name, fsync, rename) and delete its key. Returns (ranks still awaited, errors they sent).
        Cheap to poll: one store request while no new answer came."""
        answered = int(self.store.add(self._count(seq), 0))
        if answered <= self._read.get(seq, 0):
            return ranks, []
        waiting: list[int] = []
        errors: list[str] = []
        for r in ranks:
            key = self._key(seq, r)
            if not self.store.check([key]):
                waiting.append(r)
                continue
            value = bytes(self.store.get(key))
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - some stores cannot delete; the values are small
                pass
            if value[:1] != _OK:
                errors.append(f"process {r}: {value[1:].decode(errors='replace')}")
                continue
            _fs.write_bytes(os.path.join(folder, f"{RNG_STATE_NAME}_{r}.pkl"), memoryview(value)[1:], fsync)
        self._read[seq] = self._read.get(seq, 0) + len(ranks) - len(waiting)
        if not waiting:
            self.forget(seq, [])
        return waiting, errors

    def forget(self, seq: int, ranks: list[int]) -> None:
        """Save ``seq`` is over: delete its count and the answers of ``ranks`` (unread, a failed save)."""
        self._read.pop(seq, None)
        for key in [self._key(seq, r) for r in ranks] + [self._count(seq)]:
            try:
                self.store.delete_key(key)
            except Exception:  # noqa: BLE001 - some stores cannot delete; the values are small
                pass


def staging_of(folder: str) -> str:
    """A process's own staging folder beside its node's ``folder`` of a step (a lazyckpt temporary)."""
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    return _fs.temporary_path(folder)
