"""Copies of ONE writer's checkpoints (``LazyCheckpointer(levels=...)`` on every rank, rank 0 saving)
in the ``k`` next nodes' memory, under the level's own names in each holder node's folder.

The writer (``lazyckpt-replica`` thread) announces each transfer in the c10d store before its gloo
round, since a gloo receive posted ahead cannot be cancelled; a holder's ``lazyckpt-replica-rx``
thread waits for that key. A failure never fails a save. ``restore_files`` (collective, from
``latest()``) gives every node the newest step any node holds whole.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import uuid
import warnings
from collections import deque
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from lazyckpt.core.warn import user_stacklevel
from lazyckpt.errors import IncompleteCheckpointWarning, ReplicationError
from lazyckpt.levels import Level, list_steps
from lazyckpt.recovery import Preread, preread
from lazyckpt.storage import fs as _fs
from lazyckpt.threads import reentry

from ._collective import StoreExchange, in_job
from ._replica import ReplicationStats, Ring, warn_once
from ._topology import probe
from ._wire import CRC_MISMATCH, LATER, OK, FolderSink, Link, OutFile, Sink, crc_of, folder_files, header_of, open_files

logger = logging.getLogger(__name__)

POLL = timedelta(seconds=1)


def _check_file(path: str) -> None:
    """``OSError`` unless the file passes ``verify`` (the writer's CRC32s)."""
    from lazyckpt.recovery.verify import verify

    report = verify(path)
    if not report.ok:
        raise OSError(5, "; ".join(report.problems))


def _check_folder(path: str) -> None:
    """``OSError`` unless the folder checkpoint is complete and every file passes its CRC32s."""
    from lazyckpt.recovery.check import folder_problems

    problems = folder_problems(path)
    if problems:
        raise OSError(5, "; ".join(problems))


def _outgoing(path: str, crc: int | None) -> tuple[list[OutFile], bool]:
    """``path``'s files opened share-locked for sending, and whether it is a folder."""
    if os.path.isdir(path):
        return open_files(path, [(n, crc) for n, _ in folder_files(path)], lock=True), True
    return open_files(os.path.dirname(path), [(os.path.basename(path), crc)], lock=True), False


class _Job:
    """The job's view for one replicated level: the probe and the ring, agreed through the c10d
    store. ``group()`` makes a gloo group for the transfers (collective: every rank or none)."""

    def __init__(self, levels: Sequence[Level], index: int, timeout: float) -> None:
        if not in_job():
            raise ValueError(
                f"level {index} ({levels[index].path}): replicas={levels[index].replicas} needs torch.distributed: "
                "a job of several nodes (init_process_group before the checkpointer is built, on every rank)"
            )
        self.timeout = timeout
        self.exchange = StoreExchange.default(timeout)
        self.rank, self.world = self.exchange.rank, self.exchange.world
        self.gather = self.exchange.all_gather
        self.token = str(self.gather(uuid.uuid4().hex if self.rank == 0 else None)[0])
        scope = probe([levels[index]], self.token, self.rank, self.world, self.gather)[0]
        self.ring = Ring.of(index, levels[index], scope, self.rank)
        self.leaders = [g[0] for g in self.ring.groups]

    def group(self) -> Any:
        import torch.distributed as dist

        return dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))


class SingleWriter:
    """Both sides of one-writer replication; built on every rank (collective)."""

    def __init__(self, levels: Sequence[Level], index: int, fsync: bool, timeout: float = 60.0) -> None:
        self.levels, self.index, self.level, self.fsync, self.timeout = levels, index, levels[index], fsync, timeout
        job = _Job(levels, index, timeout)
        self.rank, self.group = job.rank, job.group()
        ring = job.ring
        writer = ring.node_of(0)
        n = len(ring.groups)
        self.holders = [job.leaders[(writer + j) % n] for j in range(1, ring.k + 1)]
        self.store = StoreExchange.default_store()
        self.prefix = f"lazyckpt/single/{job.token[:16]}"
        self.stats = ReplicationStats()
        self._link = Link(self.group)
        self._cond = reentry.condition()
        self._queue: deque[tuple[int, list[OutFile], bool]] = deque()
        self._queued = 0
        self._closed = False
        self._seq = {h: 0 for h in self.holders}
        self._broken: set[int] = set()
        self._warned: set[int] = set()
        self._bye = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if self.rank == 0:
            self._thread = threading.Thread(target=self._send_loop, name="lazyckpt-replica", daemon=True)
        elif self.rank in self.holders:
            self._thread = threading.Thread(target=self._receive_loop, name="lazyckpt-replica-rx", daemon=True)
        if self._thread is not None:
            self._thread.start()

    # -- the writer -------------------------------------------------------------------------------

    def submit(self, step: int, path: str) -> None:
        """Queue ``step``'s committed ``path`` for the holders, opened share-locked now. Never blocks
        (core callback thread): past ``backlog`` queued steps it is recorded as not replicated."""
        with self._cond:
            behind = self._queued >= self.level.backlog
        if behind:  # never wait here: the step goes without copies
            for holder in self.holders:
                why = f"the copies are {self.level.backlog} steps behind (the level's backlog): skipped"
                self._failed(step, holder, None, why)
            return
        try:
            files, folder = _outgoing(path, LATER)
        except OSError as exc:
            for holder in self.holders:
                self._failed(step, holder, exc.errno, f"cannot read the committed file: {exc}")
            return
        with self._cond:
            if self._closed:
                for f in files:
                    f.close()
                return
            self._queue.append((step, files, folder))
            self._queued += 1
            self._cond.notify_all()

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every queued file (each round bounded by the group's timeout)."""
        with self._cond:
            return self._cond.wait_for(lambda: self._queued == 0, timeout)

    def close(self) -> None:
        """The writer: send what is queued, then ``bye``. A holder: wait up to ``timeout`` s for the
        writer's ``bye``, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is None:
            return
        if self.rank == 0:
            self._thread.join()  # each round is bounded by the group's timeout
            return
        if not self._bye.wait(self.timeout):
            logger.info("lazyckpt: no word from the writer (rank 0) within %g s: stop holding copies", self.timeout)
        self._stop.set()
        self._thread.join(self.timeout)

    def _send_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue) or self._closed)
                if not self._queue:
                    break
                step, files, folder = self._queue.popleft()
            try:
                self._send(step, files, folder)
            except BaseException:  # noqa: BLE001 - a bug: the step is not replicated, the thread goes on
                logger.exception("lazyckpt: replication of step %d failed unexpectedly", step)
            finally:
                for f in files:
                    f.close()
                with self._cond:
                    self._queued -= 1
                    self._cond.notify_all()
        for holder in self.holders:
            if holder not in self._broken:
                self._announce(holder, {"bye": True})

    def _announce(self, holder: int, what: dict[str, Any]) -> None:
        key = f"{self.prefix}/{holder}/{self._seq[holder]}"
        self._seq[holder] += 1
        self.store.set(key, json.dumps(what))

    def _send(self, step: int, files: list[OutFile], folder: bool) -> None:
        whole = True
        for f in files:
            if f.crc == LATER:
                f.crc = crc_of(f.fd, f.size)
        for holder in self.holders:
            if holder in self._broken:
                self._failed(step, holder, None, f"rank {holder}'s pair failed earlier")
                whole = False
                continue
            try:
                self._announce(holder, {"step": step})
                ack, _ = self._link.run(holder, header_of(files, step=step, folder=folder), files, None, None)
            except Exception as exc:  # noqa: BLE001 - the pair is gone: never used again
                self._broken.add(holder)
                self._failed(step, holder, None, f"the link to rank {holder} failed: {exc}")
                whole = False
                continue
            if ack != OK:
                code = ack if ack is not None and ack > 0 else None
                why = "it refused the bytes (CRC32 mismatch with the primary's)" if ack == CRC_MISMATCH else "it failed"
                self._failed(step, holder, code, why + (f" ({os.strerror(code)})" if code else ""))
                whole = False
            else:
                self.stats.bytes_sent += sum(f.size for f in files)
                self._warned.discard(holder)
        if whole:
            self.stats.steps_replicated += 1

    def _failed(self, step: int, holder: int, code: int | None, why: str) -> None:
        level = self.level
        err = ReplicationError(
            f"lazyckpt: level {self.index} ({level.path}), step {step}: not replicated to rank {holder}: {why}; "
            "the local copy stands",
            self.index, level.path, step, list_steps(level).get(step, level.file(step)), errno=code, partner=holder,
        )  # fmt: skip
        self.stats.not_replicated[step] = err
        warn_once(self._warned, holder, err)

    # -- a holder ---------------------------------------------------------------------------------

    def _receive_loop(self) -> None:
        """A holder's thread. However it ends, ``_bye`` is set: ``close()`` never waits for a thread gone."""
        try:
            self._receive_all()
        except Exception:  # noqa: BLE001 - a bug: no more copies here, the training goes on
            logger.exception("lazyckpt: the replica receiver of rank %d failed; no more copies here", self.rank)
        finally:
            self._bye.set()

    def _receive_all(self) -> None:
        # a store connection of this thread's own: a blocking wait would stall the process's other store calls
        store = self.store.clone() if hasattr(self.store, "clone") else self.store
        seq = 0
        while True:
            key = f"{self.prefix}/{self.rank}/{seq}"
            try:
                store.wait([key], POLL)
                what = json.loads(store.get(key))
            except Exception as exc:  # noqa: BLE001 - not yet: look again, unless closed
                # The store (on the writer's host) is gone, even between the wait and the read: the writer
                # announced its last word and exited. Nothing more comes.
                if _unreachable(exc) or self._stop.is_set():
                    return
                continue
            seq += 1
            try:
                store.delete_key(key)  # one key per step per holder for the whole run otherwise
            except Exception:  # noqa: BLE001 - some stores cannot delete; the keys are small
                pass
            if what.get("bye") or not self._receive(int(what["step"])):
                return  # the writer is done, or its side of the pair is gone: nothing more comes

    def _receive(self, step: int) -> bool:
        try:
            _, sink = _received(self._link, 0, self.level, self.fsync)
        except Exception as exc:  # noqa: BLE001
            logger.warning("lazyckpt: the copy of step %d from rank 0 failed: %s; no more copies here", step, exc)
            return False
        if sink is None or sink.error is not None:
            logger.warning("lazyckpt: the copy of step %d from rank 0 not stored: %s", step, sink and sink.error)
            return True
        self.stats.bytes_received += sum(int(f["size"]) for f in sink.header.get("files", []))
        self._retain(step)
        return True

    def _retain(self, newest: int) -> None:
        keep = self.level.keep
        if keep is None:
            return
        held = list_steps(self.level)
        steps = sorted(s for s in held if s <= newest)
        for s in steps[:-keep]:
            _fs.remove_quietly(held[s])


def restore_files(
    levels: Sequence[Level], index: int, timeout: float, fsync: bool, threads: int = 8, preload: bool = False
) -> list[Preread]:
    """Collective (every rank): the newest step any node's folder of level ``index`` holds whole is
    sent to every node lacking it. ``preload``: the checks read the files' storages (``preread``);
    returned, for the caller to keep until ``latest()`` has taken them."""
    job = _Job(levels, index, timeout)
    level, ring = levels[index], job.ring
    mine: int | None = None
    kept: list[Preread] = []
    check = _read_ahead_check(kept, threads) if preload else _check_file  # own files and received copies
    steps: dict[int, str] = {}
    if job.rank in job.leaders:
        steps = list_steps(level)
        for s in sorted(steps, reverse=True):
            try:
                (_check_folder if os.path.isdir(steps[s]) else check)(steps[s])
            except OSError as exc:
                warnings.warn(
                    f"lazyckpt.latest: skipping {steps[s]} (level {index}, step {s}): {exc.strerror or exc}",
                    IncompleteCheckpointWarning,
                    stacklevel=user_stacklevel(),
                )
                continue
            mine = s
            break
    everyone = job.gather(mine)
    held = {node: everyone[leader] for node, leader in enumerate(job.leaders)}
    newest = max((s for s in held.values() if s is not None), default=None)
    plan = [] if newest is None else [node for node in range(len(ring.groups)) if held[node] != newest]
    if plan:
        assert newest is not None
        holder = next(node for node in range(len(ring.groups)) if held[node] == newest)
        group = job.group()
        link = Link(group)
        for node in plan:
            src, dst = job.leaders[holder], job.leaders[node]
            try:
                if job.rank == src:
                    files, folder = _outgoing(steps[newest], None)
                    try:
                        link.run(dst, header_of(files, step=newest, folder=folder), files, None, None)
                    finally:
                        for f in files:
                            f.close()
                elif job.rank == dst:
                    _received(link, src, level, fsync, check)
                    for ahead in kept:  # read under its temporary name, renamed since (files only)
                        ahead.moved(level.file(newest))
            except Exception as exc:  # noqa: BLE001 - that node goes without: latest() then agrees lower
                logger.warning("lazyckpt.latest: step %d to node %d from node %d failed: %s", newest, node, holder, exc)
        job.gather(None)  # every round is over on every rank (and every folder settled): the group is unused
        _destroy(group)
    return kept


def _destroy(group: Any) -> None:
    import torch.distributed as dist

    dist.destroy_process_group(group)


def files_of_one_writer(listings: dict[int, dict[int, str]], is_dcp: Any, timeout: float) -> bool:
    """Collective in a multi-rank job (else False): whether some rank lists a file checkpoint and
    none a DCP folder."""
    if not in_job():
        return False
    paths = [p for steps in listings.values() for p in steps.values()]
    mine = "dcp" if any(is_dcp(p) for p in paths) else "files" if paths else "none"
    out = StoreExchange.default(timeout).all_gather(mine)
    return "files" in out and "dcp" not in out


def _read_ahead_check(kept: list[Preread], threads: int) -> Any:
    """``_check_file`` that also keeps the file's read storages in ``kept`` for ``latest()``."""

    def check(path: str) -> None:
        report, ahead = preread(path, threads)
        if not report.ok:
            raise OSError(5, "; ".join(report.problems))
        kept.extend([ahead] if ahead is not None else [])

    return check


def _received(
    link: Link, src: int, level: Level, fsync: bool, check: Any = _check_file
) -> tuple[int | None, Sink | None]:
    """One round receiving ``src``'s checkpoint into ``level``'s folder; a failure leaves no temporary."""
    made: list[Sink] = []

    def sink_for(head: dict[str, Any]) -> Sink:
        if head.get("folder"):
            made.append(FolderSink(level.folder(int(head["step"])), head, fsync, _check_folder))
        else:
            made.append(Sink(level.path, head, fsync, None, check=check))
        return made[-1]

    try:
        return link.run(None, None, [], src, sink_for)
    except BaseException:
        for sink in made:
            sink.abandon()
        raise


def _unreachable(exc: BaseException) -> bool:
    """A store error that is no timeout: the connection to the store is lost."""
    import torch.distributed as dist

    network = getattr(dist, "DistNetworkError", None)
    return network is not None and isinstance(exc, network)
