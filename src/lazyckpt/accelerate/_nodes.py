"""``install(accelerator, levels=...)`` in a job of several nodes: who shares each level's folder,
and the RNG files of the processes that cannot write into the main process's folder.

Accelerate's ``save_state`` (``save_on_each_node=False``) has the main process write the model,
optimizer, scheduler and sampler files, and every process its own ``random_states_<i>.pkl``. In a
folder every process shares, that is one complete folder. In a node-local level (the probe finds it
shared by one node's processes only, e.g. ``/dev/shm/run`` on every node) only the main process's
node could; so the main process's folder is made complete by it (DDP: the other files are the
same on every process):

    every process, at install (collective): the levels' scopes (``levels.probe``); a node-local
        level without ``replicas`` is refused (the other nodes could not resume from it)
    a process outside the main process's group of the fastest due level: its lazy ``save_state``
        writes into a staging folder of its own (``_fs.temporary_path``, in its node's level
        folder); once its part ended (its finisher thread), ``post`` puts its RNG file's bytes in
        the job's c10d store (``lazyckpt/accelerate/<token>/<seq>/<rank>``; an error instead when
        its part failed) and the staging folder is removed
    the main process: a marker of its own in the folder from ``save()``, before the processes agree
        on the step (``hold``; with one node too: ``_levels.LevelSaves._claim``) until every process's
        part ended and ``collect`` has written every such process's RNG file into the folder (temporary name,
        fsync, rename); the folder is complete, its level handle done, only then: the copies to
        the slower levels and to the other nodes' memory (``levels.SingleWriter``, through the
        ``MultiLevel``), and on a restart ``lazyckpt.latest()`` gives every node the newest step.

``seq`` counts the bare saves with a due level, alike on every process (they agree on the step).
A process of another node that dies leaves no marker the main process can see (its staging folder
is on its own node): with a node-local level every process but the main one beats in the store
(``lazyckpt.distributed.Liveness``, every 0.5 s, the ``lazyckpt-heartbeat`` thread), and the main
process's wait for RNG files fails once one it awaits has not beaten for 6 s.

Owns: the keys it posts (the main process deletes each once read), its markers, the heartbeat
thread (stopped by ``close``). Waits: none of its own (the main process's watcher thread polls
``collect`` and ``dead``, bounded by ``load_timeout``).
"""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from collections.abc import Sequence

from accelerate.utils.constants import RNG_STATE_NAME

from lazyckpt.commit.folder import marker_name
from lazyckpt.distributed import DEAD_AFTER_S, Liveness
from lazyckpt.levels import Level, Scope, StoreExchange, probe
from lazyckpt.storage import fs as _fs

_OK, _ERR = b"\x00", b"\x01"


class Nodes:
    """The levels' scopes in a job of several processes, and the RNG files' exchange (see the module docstring)."""

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
        for level in levels:  # what a killed process of this host left (staging, copies half-received)
            if not level.is_url:
                _fs.cleanup_temporaries(level.path)
        self.rank, self.world = rank, world
        self.store = StoreExchange.default_store()
        self.prefix = f"lazyckpt/accelerate/{token[:16]}"
        self._seq = 0
        self._read: dict[int, int] = {}  # save -> answers read so far (the main process)
        # a process of another node that dies leaves no marker the main process can see: with a
        # node-local level, every other process beats in the store (``distributed``'s heartbeat),
        # and the main process's wait for RNG files ends once one of those it awaits stops
        self._stop = threading.Event()
        self._liveness: Liveness | None = None
        if any(scope.node_local for scope in self.scopes):
            self._liveness = Liveness(self.store, f"accelerate-{token[:16]}", rank, world)
            if rank != 0:
                self._liveness.beat()
                threading.Thread(
                    target=self._liveness.run, args=(self._stop,), name="lazyckpt-heartbeat", daemon=True
                ).start()

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
        self._stop.set()

    def _key(self, seq: int, rank: int) -> str:
        return f"{self.prefix}/{seq}/{rank}"

    def _count(self, seq: int) -> str:
        return f"{self.prefix}/{seq}/answers"

    # -- a process outside the main process's folder --------------------------------------------------

    def post(self, seq: int, staging: str, error: BaseException | None) -> None:
        """This process's RNG file of save ``seq`` (written into ``staging``) to the main process,
        or the error that ended its part; ``staging`` removed."""
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
        self.store.add(self._count(seq), 1)  # after the value: a count the main process sees has its key

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
        """A marker of the main process's in ``folder`` (made now): the folder is incomplete until
        ``release``; a main process that dies leaves it (stale: the folder is never chosen)."""
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
        """Each of ``ranks`` whose answer to save ``seq`` arrived: its RNG file written into
        ``folder`` (temporary name, fsync, rename), its key deleted. Returns (the ranks still
        awaited, the errors they sent). One store request while no new answer came (the count):
        the main process polls this every 5-100 ms, however many processes it waits for."""
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
            final = os.path.join(folder, f"{RNG_STATE_NAME}_{r}.pkl")
            tmp = _fs.temporary_path(final)
            try:
                fd = _fs.open_temporary(tmp, len(value) - 1)
                try:
                    _fs.pwrite_all(fd, memoryview(value)[1:], 0)
                    if fsync:
                        _fs.fsync(fd)
                finally:
                    _fs.close(fd)
                _fs.commit(tmp, final, fsync)
            except BaseException:
                _fs.discard(tmp)
                raise
        self._read[seq] = self._read.get(seq, 0) + len(ranks) - len(waiting)
        if not waiting:
            self.forget(seq, [])
        return waiting, errors

    def forget(self, seq: int, ranks: list[int]) -> None:
        """Save ``seq`` is over: the answers of ``ranks`` that arrived deleted unread (a failed save),
        and its count."""
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
