"""The two-phase, multi-rank commit of a checkpoint folder, through the c10d store.

Every rank writes its file durably into a staging folder beside the final one and posts a report
under its own key; the coordinator writes ``.metadata`` and the manifest, decides by an atomic
``compare_set`` of the outcome key (a rank that times out tries to set ``abort`` the same way: the
first decision holds), then renames the folder into place. Not a collective: safe from a background
thread, and with nccl training. The decisions themselves: ``_decide.py``.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lazyckpt.formats.dcp import MANIFEST, METADATA
from lazyckpt.storage.fs import fsync_dir
from lazyckpt.threads import reentry

logger = logging.getLogger(__name__)

# ``-<n>``: a path save's number; ``-<n>-<level>``: one level's folder of a multi-level save.
_STAGING_RE = re.compile(r"^\..+\.lazyckpt-dist-([0-9a-f]+)-\d+(?:-\d+)?(-old)?\.tmp$")
# Waits poll with short requests and back off: a blocking ``store.wait`` would hold the process's
# store client lock (shared with the training's store traffic) for the whole wait.
_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.1


def _polls(deadline: float) -> Iterator[bool]:
    """Yield True while time is left before ``deadline``, then False; sleeps a growing interval between."""
    delay = _POLL_MIN_S
    while True:
        yield time.monotonic() < deadline
        time.sleep(delay)
        delay = min(delay * 2, _POLL_MAX_S)


# Each rank's heartbeat thread bumps its counter every HEARTBEAT_S; a counter that has not moved for
# DEAD_AFTER_S by the observer's own clock (no clock compared across hosts) means dead or cut off.
# DEAD_AFTER_S leaves room for threads starved for a few seconds (a long call holding the GIL).
HEARTBEAT_S, DEAD_AFTER_S = 0.5, 6.0


class Liveness:
    """One checkpointer's heartbeat (``beat``, on its own thread) and its view of the others'."""

    def __init__(self, store: Any, token: str, rank: int, world_size: int) -> None:
        self.store, self.token, self.rank, self.world_size = store, token, rank, world_size
        self._seen: dict[int, tuple[int, float, float]] = {}  # rank -> (counter, when it moved, looked up)
        self._lock = reentry.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def key(self, rank: int) -> str:
        return f"lazyckpt/{self.token}/alive/r{rank}"

    def beat(self) -> None:
        self.store.add(self.key(self.rank), 1)

    def start(self, name: str) -> None:
        """Beat now, then every ``HEARTBEAT_S`` on a daemon thread ``name`` until ``stop()``."""
        self.beat()
        self._thread = threading.Thread(target=self.run, args=(self._stop,), name=name, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the heartbeat thread (if started); bounded: a beat to a dead store host may block for the
        store's timeout, so the join gives up after 5 s (a daemon thread)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)

    def run(self, stop: threading.Event) -> None:
        """Beat every ``HEARTBEAT_S`` until ``stop``; a failed beat is logged and retried at the next."""
        while not stop.wait(HEARTBEAT_S):
            try:
                self.beat()
            except Exception as exc:  # noqa: BLE001 - the heartbeat must outlive a store hiccup
                logger.debug("lazyckpt: heartbeat of rank %d failed: %s", self.rank, exc)

    def dead(self, ranks: list[int] | range) -> list[int]:
        """Those of ``ranks`` whose heartbeat stopped (each counter looked up at most every ``HEARTBEAT_S``)."""
        now = time.monotonic()
        dead = []
        with self._lock:
            for r in ranks:
                if r == self.rank:
                    continue
                value, moved, looked = self._seen.get(r, (-1, now, 0.0))
                if now - looked >= HEARTBEAT_S:
                    current = int(self.store.add(self.key(r), 0))
                    if current != value:
                        value, moved = current, now
                    looked = now
                self._seen[r] = (value, moved, looked)
                if now - moved > DEAD_AFTER_S:
                    dead.append(r)
        return dead


# Tokens of the checkpointers open in this process: their staging directories are never leftovers.
live_tokens: set[str] = set()
_live_lock = reentry.Lock()


def add_live(token: str) -> None:
    """A checkpointer of this process is open under ``token``: its staging folders are not leftovers."""
    with _live_lock:
        live_tokens.add(token)


def discard_live(token: str) -> None:
    with _live_lock:
        live_tokens.discard(token)


def staging_path(final: str, token: str, n: int | str, old: bool = False) -> str:
    head, tail = os.path.split(final)
    return os.path.join(head, f".{tail}.lazyckpt-dist-{token}-{n}{'-old' if old else ''}.tmp")


def cleanup_leftovers(directory: str) -> list[str]:
    """Remove staging folders in ``directory`` whose checkpointer is not open in this process (their
    saves died); a moved-aside previous checkpoint whose final name is free is renamed back."""
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return removed
    with _live_lock:
        live = set(live_tokens)
    for name in names:
        m = _STAGING_RE.match(name)
        if m and m.group(1) not in live:
            path = os.path.join(directory, name)
            final = os.path.join(directory, name[1 : name.index(".lazyckpt-dist-")])
            if m.group(2) and not os.path.lexists(final):
                # swap_in() moved it aside (no RENAME_EXCHANGE) and died: put it back, never delete it.
                os.rename(path, final)
                logger.warning("lazyckpt: restored %s from %s (a save died while replacing it)", final, path)
                continue
            shutil.rmtree(path, ignore_errors=True)
            if not os.path.lexists(path):
                removed.append(path)
    if removed:
        logger.info(
            "lazyckpt: removed %d leftover staging folder(s) of dead distributed saves in %s", len(removed), directory
        )
    return removed


@dataclass
class RankReport:
    """What a rank posts once its part of a save is over."""

    rank: int
    ok: bool
    file: str = ""  # relative name of its data file
    size: int = 0
    crc: int | None = None
    storage_data: Any = None  # {MetadataIndex: _StorageInfo}
    error: str = ""  # "<type>: <message>" when not ok
    upload_failed: bool = False  # a save to a URL: this rank's upload failed (not its local file)
    needs: Any = None  # multi-level saves: the items this rank saved before deduplication (its shard)
    extra_files: dict[str, bytes] | None = None  # rank 0, a node-local level: its extra files, for every node's leader


@dataclass(frozen=True)
class Decision:
    """How save ``n`` was decided; the first decision set in the store holds (``StoreProtocol.decide``)."""

    commit: bool
    why: str = ""  # an abort's reason, as every rank reports it
    ranks: tuple[int, ...] = ()  # the ranks that failed or vanished (empty: unknown)
    upload: bool = False  # a save to a URL aborted because an upload failed

    @classmethod
    def abort(cls, why: str, ranks: list[int] | tuple[int, ...], upload: bool = False) -> Decision:
        return cls(False, why, tuple(ranks), upload)

    def encode(self) -> str:
        if self.commit:
            return "commit"
        return "abort:" + json.dumps({"why": self.why, "ranks": list(self.ranks), "upload": self.upload})

    @classmethod
    def decode(cls, raw: str) -> Decision:
        if raw == "commit":
            return COMMIT
        body = json.loads(raw.removeprefix("abort:"))
        return cls.abort(body["why"], body["ranks"], bool(body.get("upload")))


COMMIT = Decision(True)


@dataclass(frozen=True)
class CommitResult:
    """How publishing a committed save ended (the coordinator's rename, or its ``.metadata`` upload)."""

    ok: bool
    why: str = ""

    def encode(self) -> str:
        return "ok" if self.ok else "err:" + self.why

    @classmethod
    def decode(cls, raw: str) -> CommitResult:
        return cls(True) if raw == "ok" else cls(False, raw.removeprefix("err:"))


class StoreProtocol:
    """Keys of one checkpointer's saves in the c10d store (``lazyckpt/<token>/<n>/...``)."""

    def __init__(self, store: Any, token: str, rank: int, world_size: int) -> None:
        self.store, self.token, self.rank, self.world_size = store, token, rank, world_size

    def _key(self, n: int | str, name: str) -> str:
        return f"lazyckpt/{self.token}/{n}/{name}"

    def post(self, n: int | str, report: RankReport) -> None:
        self.store.set(self._key(n, f"r{report.rank}"), pickle.dumps(report))
        if not report.ok:
            self.store.set(self._key(n, "failed"), str(report.rank))
        self.store.add(self._key(n, "reported"), 1)

    def gather(
        self, n: int | str, deadline: float, liveness: Liveness | None = None
    ) -> tuple[dict[int, RankReport], list[int], list[int]]:
        """Reports of every rank (or those in by ``deadline``, or once one failed or an unreported
        rank died), the ranks missing then, and the dead among them."""
        dead: list[int] = []
        for time_left in _polls(deadline):
            everyone = int(self.store.add(self._key(n, "reported"), 0)) >= self.world_size
            if everyone or self.store.check([self._key(n, "failed")]) or not time_left:
                break
            if liveness is not None and (dead := self._dead_unreported(n, liveness)):
                break
        reports: dict[int, RankReport] = {}
        missing: list[int] = []
        for r in range(self.world_size):
            key = self._key(n, f"r{r}")
            if self.store.check([key]):
                reports[r] = pickle.loads(self.store.get(key))
            else:
                missing.append(r)
        if any(not rep.ok for rep in reports.values()):
            return reports, [], []  # decided by the failure; the others may still be on their way
        return reports, missing, [r for r in dead if r in missing]

    def _dead_unreported(self, n: int | str, liveness: Liveness) -> list[int]:
        dead = liveness.dead(range(self.world_size))
        return [r for r in dead if not self.store.check([self._key(n, f"r{r}")])]

    def decide(self, n: int | str, decision: Decision) -> Decision:
        """Set the decision unless someone did first; return the decision that holds."""
        return Decision.decode(bytes(self.store.compare_set(self._key(n, "outcome"), "", decision.encode())).decode())

    def wait_decision(self, n: int | str, deadline: float, liveness: Liveness | None = None) -> Decision | None:
        """The coordinator's decision, or None at ``deadline`` or once it is dead."""
        raw = self.wait_value(n, "outcome", deadline, liveness, 0)
        return None if raw is None else Decision.decode(raw)

    def wait_result(self, n: int | str, deadline: float, liveness: Liveness | None = None) -> CommitResult | None:
        """How the coordinator's publishing ended, or None at ``deadline`` or once it is dead."""
        raw = self.wait_value(n, "result", deadline, liveness, 0)
        return None if raw is None else CommitResult.decode(raw)

    def wait_value(
        self, n: int | str, name: str, deadline: float, liveness: Liveness | None = None, writer: int = 0
    ) -> str | None:
        """The key's value, or None at ``deadline`` or once ``writer`` (the rank that sets it) is dead."""
        key = self._key(n, name)
        for time_left in _polls(deadline):
            if self.store.check([key]):
                return bytes(self.store.get(key)).decode()
            if not time_left or (liveness is not None and liveness.dead([writer])):
                return None
        raise AssertionError("unreachable")

    def set_result(self, n: int | str, result: CommitResult) -> None:
        self.store.set(self._key(n, "result"), result.encode())

    def ack(self, n: int | str) -> None:
        """A rank has read how save ``n`` ended (it needs the store no more for it)."""
        self.store.set(self._key(n, f"a{self.rank}"), "1")  # who: a dead rank is not waited for
        self.store.add(self._key(n, "acks"), 1)

    def wait_acks(self, n: int | str, ranks: list[int], deadline: float, liveness: Liveness | None = None) -> bool:
        """Wait until every one of ``ranks`` acknowledged (True), or ``deadline`` or every live one
        did (False). The coordinator often hosts the store: exiting before the others read the
        outcome would fail a save that committed."""
        for time_left in _polls(deadline):
            if int(self.store.add(self._key(n, "acks"), 0)) >= len(ranks):
                return True
            if liveness is not None and (dead := liveness.dead(ranks)):
                alive = [r for r in ranks if r not in dead]
                if all(self.store.check([self._key(n, f"a{r}")]) for r in alive):
                    return False  # the dead will never acknowledge: stop waiting, keep the keys
            if not time_left:
                return False
        raise AssertionError("unreachable")

    def reports(self, n: int | str, ranks: list[int] | tuple[int, ...]) -> dict[int, RankReport]:
        """The reports ``ranks`` posted for save ``n`` (each must be there: every rank reported)."""
        return {r: pickle.loads(self.store.get(self._key(n, f"r{r}"))) for r in ranks}

    def set_value(self, n: int | str, name: str, value: str) -> None:
        self.store.set(self._key(n, name), value)

    def drop(self, n: int | str, extra: tuple[str, ...] = ()) -> None:
        """Delete save ``n``'s keys (once every rank has acknowledged); ``extra``: more key names."""
        names = [f"r{r}" for r in range(self.world_size)] + [f"a{r}" for r in range(self.world_size)]
        names += ["outcome", "result", "acks", "reported", "failed", *extra]
        for name in names:
            try:
                self.store.delete_key(self._key(n, name))
            except Exception:  # some stores cannot delete; the keys are small
                return


def write_metadata(
    staging: str,
    final: str,
    save_id: str,
    metadata: Any,
    reports: dict[int, RankReport],
    fsync: bool,
    extra_files: dict[str, bytes] | None = None,
    world_size: int | None = None,
) -> None:
    """Write ``.metadata``, ``extra_files`` and the manifest (per-file sizes and CRCs, for
    ``verify_checkpoint``) durably into ``staging``. ``reports``: every rank's, or one node's ranks'
    (a node-local level; ``world_size`` the job's). The manifest also records ``complete`` (every
    item is here) and, for reports with ``needs``, the files each rank reads back (``ranks``)."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    from torch.distributed.checkpoint.metadata import StorageMeta

    storage: dict[Any, Any] = {}
    for report in reports.values():
        storage.update(report.storage_data)
    metadata.version = CURRENT_DCP_VERSION
    metadata.storage_data = storage
    metadata.storage_meta = StorageMeta(checkpoint_id=final, save_id=save_id)  # as FileSystemWriter.finish
    blob = pickle.dumps(metadata)
    from lazyckpt.formats.crc import crc32

    files = {
        r.file: {"size": r.size, "crc32": r.crc, "rank": r.rank} for r in sorted(reports.values(), key=lambda r: r.rank)
    }
    for name, data in (extra_files or {}).items():
        _write_file(os.path.join(staging, name), data, fsync)
        files[name] = {"size": len(data), "crc32": crc32(data), "rank": None}
    manifest: dict[str, Any] = {
        "format": "lazyckpt-dcp/1",
        "world_size": len(reports) if world_size is None else world_size,
        "files": files,
        METADATA: {"size": len(blob), "crc32": crc32(blob)},
        "items": sorted([info.relative_path, info.offset, info.length] for info in storage.values()),
        "complete": _covers_every_item(metadata, storage),
    }
    ranks = _files_by_rank(reports, storage)
    if ranks:
        manifest["ranks"] = ranks
    _write_file(os.path.join(staging, METADATA), blob, fsync)
    _write_file(os.path.join(staging, MANIFEST), json.dumps(manifest, indent=1).encode(), fsync)
    if fsync:
        fsync_dir(staging)


def _covers_every_item(metadata: Any, storage: dict[Any, Any]) -> bool:
    """Whether ``storage`` locates every item of ``metadata``: a folder any world size can load."""
    from torch.distributed.checkpoint.metadata import MetadataIndex

    for fqn, md in metadata.state_dict_metadata.items():
        chunks = getattr(md, "chunks", None)
        wanted = [MetadataIndex(fqn)] if chunks is None else [MetadataIndex(fqn, c.offsets) for c in chunks]
        if any(index not in storage for index in wanted):
            return False
    return True


def _files_by_rank(reports: dict[int, RankReport], storage: dict[Any, Any]) -> dict[str, list[str]]:
    """Per rank whose ``needs`` are all in ``storage``: the files it reads to load its own shard."""
    out: dict[str, list[str]] = {}
    for report in reports.values():
        if report.needs is None:
            continue
        infos = [storage.get(index) for index in report.needs]
        if all(info is not None for info in infos):
            out[str(report.rank)] = sorted({info.relative_path for info in infos if info is not None})
    return out


def _write_file(path: str, data: bytes, fsync: bool) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        if fsync:
            os.fsync(fh.fileno())
