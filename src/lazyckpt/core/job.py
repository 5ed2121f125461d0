"""Job: one save on its way from staging to commit, and the pieces it is cut into.

Touched by ``save()``, the stager, the writers, the committer and confirming threads. Two states under
one lock, changed only by ``Job._move``: ``Stage`` (the caller's tensors, ``_STAGE_MOVES``) and
``FileState`` (the temporary file). The committer commits once the file is WRITTEN and the stage
CONFIRMED, or the job failed. Failure is not a state: the first error wins, later steps become cleanup,
and the states still move on so that every waiter wakes.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch

from lazyckpt.core import guard as _guard
from lazyckpt.core.handle import Completion, SaveStats
from lazyckpt.core.pool import Buffer
from lazyckpt.errors import StaleTensorError
from lazyckpt.formats.base import Layout
from lazyckpt.formats.capture import Source
from lazyckpt.formats.crc import crc32_combine
from lazyckpt.threads import reentry

# How a failed save's error is put to its caller (set by ``schedule/_multi.py`` around a level's saves); each
# job takes the value current in ``save()``; the engine applies it before the error is published.
error_context: ContextVar[Callable[[BaseException], BaseException] | None] = ContextVar(
    "lazyckpt_error_context", default=None
)
#: False while an integration saves into a staging folder it fsyncs and renames whole: the files' renames
#: inside it skip the folder fsync (their data is still fsynced).
sync_parent: ContextVar[bool] = ContextVar("lazyckpt_sync_parent", default=True)


class Stage(enum.IntEnum):
    """How far a job is with the caller's tensors; ordered, so ``stage >= READ`` reads "nothing reads
    them any more". It only moves forward (``Job._move``)."""

    STAGING = 0  # the stager has not yet copied (or queued live) the lazy CPU sources
    CPU_STAGED = 1  # it has; CUDA copies are being queued
    COPIES_QUEUED = 2  # every copy is issued; the stager, live pieces, device copies may still read
    VERIFIED = 3  # CUDA: versions checked on the stepping thread while the copies still run
    READ = 4  # nothing reads the tensors any more; a check on a thread that mutates them is missing
    CONFIRMED = 5  # checked after the reads on such a thread (or failed, or nothing lazy): may commit


class FileState(enum.IntEnum):
    """Where the job's temporary file is."""

    NEW = 0  # not created: the first thread that needs it creates it (``Engine.open``)
    OPEN = 1  # creation tried: ``fd >= 0``, or the job has failed
    WRITTEN = 2  # every byte written and fsynced, descriptors closed (or failed): the committer's turn


# The allowed moves (two tables: IntEnum members of the two enums compare equal as ints).
_STAGE_MOVES: dict[Stage, tuple[Stage, ...]] = {
    Stage.STAGING: (Stage.CPU_STAGED,),
    Stage.CPU_STAGED: (Stage.COPIES_QUEUED,),
    Stage.COPIES_QUEUED: (Stage.VERIFIED, Stage.READ, Stage.CONFIRMED),
    Stage.VERIFIED: (Stage.CONFIRMED,),
    Stage.READ: (Stage.CONFIRMED,),
    Stage.CONFIRMED: (),
}
_FILE_MOVES: dict[FileState, tuple[FileState, ...]] = {
    FileState.NEW: (FileState.OPEN, FileState.WRITTEN),  # NEW -> WRITTEN: failed before any write
    FileState.OPEN: (FileState.WRITTEN,),
    FileState.WRITTEN: (),
}


class PieceState(enum.Enum):
    """Where a live piece is: QUEUED -> WRITING (written from the tensor's memory), or QUEUED -> CLAIMED ->
    COPIED -> WRITING (copied to a buffer before the step). A staged piece stays QUEUED."""

    QUEUED = "queued"
    CLAIMED = "claimed"
    COPIED = "copied"
    WRITING = "writing"


class WriteFrom(enum.Enum):
    """Which bytes a writer writes for a piece it took."""

    BUFFER = "buffer"  # the piece's staged host buffer
    LIVE = "live"  # the source tensor's own memory (zero copy)


@dataclass(eq=False)
class Piece:
    """Bytes [start, start + nbytes) of one source, staged in ``buffer``, bound for ``file_offset``."""

    job: Job
    source: Source
    start: int
    nbytes: int
    buffer: Buffer | None = None
    event: Any = None  # torch.cuda.Event once the device-to-host copy is queued
    live: bool = False  # written straight from the source's memory unless the guard copies it first
    state: PieceState = PieceState.QUEUED

    @property
    def file_offset(self) -> int:
        return self.source.file_offset + self.start


class Job:
    def __init__(
        self,
        *,
        path: str,
        tmp: str,
        fmt: str,
        sources: list[Source],
        lazy: list[Source],
        layout: Layout,
        file_bytes: int,
        crc: bool,
        fsync: bool,
        wait_in_closure: bool,
        t0: float,
        before_commit: Callable[[], object] | None = None,
    ) -> None:
        self.completion = Completion(path)  # the engine finishes it; save() returns its handle
        self.handle = self.completion.handle
        self.path, self.tmp, self.fmt = path, tmp, fmt
        self.sources, self.lazy = sources, lazy
        self.layout = layout
        self.nbytes = sum(s.nbytes for s in sources)
        self.file_bytes = file_bytes
        self.crc, self.fsync, self.wait_in_closure = crc, fsync, wait_in_closure
        self.before_commit = before_commit
        self.sync_parent = fsync and sync_parent.get()
        # Set when a re-entered save() of the same path supersedes this one (Engine.supersede).
        self.superseded = False
        self.publishing = False
        self.published = False
        self._describe_error = error_context.get()
        self.fd = -1
        self.dfd = -1  # O_DIRECT descriptor of the same file, when used
        self.direct = False  # open an O_DIRECT descriptor too
        # One writer at a time for a memory filesystem's file (see ``Engine._queue_write``), also when
        # its pieces fall back to the writer pool.
        self.serial: reentry.Lock | None = None
        # State, counters, piece states and error: behind ``_lock``; creating the file (slow) has ``open_lock``.
        self._lock = reentry.Lock()
        self._changed = threading.Condition(self._lock)  # type: ignore[arg-type]  # (a Lock by its interface)
        self.open_lock = reentry.Lock()
        self._stage = Stage.STAGING
        self._file = FileState.NEW
        self.error: BaseException | None = None
        # Pieces not yet written, plus one held by the stager until it has queued every piece.
        self._outstanding = 1
        # Readers of live memory: the stager until it is through, plus each live piece until it is
        # written or copied. The last one out checks versions and releases the guard (reading_over).
        self._readers = 1
        self._crcs: dict[str, list[tuple[int, int, int]]] = {}
        self.save_events: dict[torch.device, Any] = {}  # compute-stream events recorded in save()
        self.last_events: dict[torch.device, Any] = {}  # last copy-stream event per device
        self.t0 = t0
        self.t_returned = t0
        self.t_staged = t0
        self.t_write_start: float | None = None
        self.t_written = t0
        self.guard_wait_s = 0.0
        self.live_pieces: list[Piece] = []
        self.settle: Callable[[Job], None] | None = None  # Engine.settle: copy what is not written yet
        self.ahead: Callable[[Job], list[Job]] | None = None  # Engine.ahead: the jobs committed before it
        self.completion.bind(settle=self._settle_for_wait, confirm=self._confirm_for_wait)

    def __repr__(self) -> str:
        failed = " failed" if self.error is not None else ""
        return f"<Job {self.path!r} {self._stage.name} file {self._file.name}{failed}>"

    # -- the state --------------------------------------------------------------------------------

    @property
    def stage(self) -> Stage:
        return self._stage

    @property
    def file(self) -> FileState:
        return self._file

    def _move(self, to: Stage | FileState) -> None:
        """The one place a job changes state (the caller holds ``_lock``): only the moves in
        ``_STAGE_MOVES`` / ``_FILE_MOVES``; CONFIRMED drops the lazy tensors; every waiter looks again."""
        if isinstance(to, Stage):
            if to not in _STAGE_MOVES[self._stage]:
                raise RuntimeError(f"lazyckpt internal error: {self!r} cannot move to {to.name}")
            self._stage = to
            if to is Stage.CONFIRMED:
                for src in self.lazy:
                    src.release()
        else:
            if to not in _FILE_MOVES[self._file]:
                raise RuntimeError(f"lazyckpt internal error: {self!r} cannot move its file to {to.name}")
            self._file = to
        self._changed.notify_all()

    def reach(self, to: Stage | FileState) -> None:
        """Move to ``to`` unless the job is there or further already (the stager marks its steps
        again in its ``finally``; a failed finalisation marks the file written twice)."""
        with self._lock:
            if (self._stage < to) if isinstance(to, Stage) else (self._file < to):
                self._move(to)

    def wait_for(self, stage: Stage, timeout: float | None = None) -> bool:
        """Block until the job is at ``stage`` or further; False when ``timeout`` ran out first."""
        if self._stage >= stage:
            return True
        with self._lock:
            return self._changed.wait_for(lambda: self._stage >= stage, timeout)

    def wait_committable(self) -> None:
        """The committer: block until the file is written and then the save is confirmed, or the job
        failed (never commit before a check ordered after the caller's ops)."""
        with self._lock:
            self._changed.wait_for(self._committable)

    def _committable(self) -> bool:
        return self._file is FileState.WRITTEN and (self.error is not None or self._stage is Stage.CONFIRMED)

    # -- errors -----------------------------------------------------------------------------------

    def described(self, exc: BaseException) -> BaseException:
        """``exc`` as this save's caller is to get it (``error_context`` at ``save()``)."""
        return exc if self._describe_error is None else self._describe_error(exc)

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc
            self._changed.notify_all()  # a wait for its confirmation ends (``_confirm_for_wait``)

    def _stale(self, sources: list[Source]) -> StaleTensorError | None:
        for src in sources:
            name = src.first_stale()
            if name is not None:
                return StaleTensorError(
                    f"save to {self.path} abandoned: tensor {name!r} was modified in place before its copy "
                    "was complete, so the file would have mixed two training states. Mutate saved tensors "
                    "only after handle.wait_staged() (optimizer steps wait automatically).",
                    path=self.path,
                    tensor_name=name,
                )
        return None

    def check_stale(self, sources: list[Source]) -> None:
        """Fail the job if one of ``sources``' tensors moved its version since ``save()``."""
        err = self._stale(sources)
        if err is not None:
            self.fail(err)

    def check_early(self, sources: list[Source]) -> None:
        """The stager's early (not sound) check of CUDA sources once their copies landed; skipped once the
        guard verified them (the step may then change them)."""
        with self._lock:
            if self._stage < Stage.VERIFIED:
                err = self._stale(sources)
                if err is not None and self.error is None:
                    self.error = err

    # -- pieces -----------------------------------------------------------------------------------

    def piece_added(self) -> None:
        with self._lock:
            self._outstanding += 1

    def piece_written(self, piece: Piece, crc: int) -> None:
        self.pieces_written([(piece, crc)])

    def pieces_written(self, written: list[tuple[Piece, int]]) -> None:
        """Record written pieces' CRCs under one lock (not counted out: ``save()``'s inline writes run while
        the stager's count holds the job back from finalising)."""
        with self._lock:
            for piece, crc in written:
                self._crcs.setdefault(piece.source.key, []).append((piece.file_offset, crc, piece.nbytes))

    def piece_done(self) -> bool:
        """Count a finished piece; True when the job is ready to finalise."""
        with self._lock:
            self._outstanding -= 1
            return self._outstanding == 0

    def all_submitted(self) -> bool:
        """The stager has queued every piece (its count out); True when the job is ready to finalise."""
        return self.piece_done()

    def add_live(self, piece: Piece) -> None:
        with self._lock:
            self._outstanding += 1
            self._readers += 1
            self.live_pieces.append(piece)

    def reader_done(self) -> bool:
        """Count a reader of live memory out; True for the last one."""
        with self._lock:
            self._readers -= 1
            return self._readers == 0

    def claim_live(self) -> list[Piece]:
        """Live pieces no writer has started: the caller copies them now."""
        with self._lock:
            claimed = [p for p in self.live_pieces if p.state is PieceState.QUEUED]
            for p in claimed:
                p.state = PieceState.CLAIMED
            return claimed

    def copied(self, piece: Piece) -> bool:
        """A claimed piece is in its buffer (or given up): one reader out; True for the last one."""
        with self._lock:
            piece.state = PieceState.COPIED
            self._readers -= 1
            return self._readers == 0

    def take(self, piece: Piece) -> WriteFrom | None:
        """A writer takes a piece: from its staged ``BUFFER``, from the tensor's own memory (``LIVE``),
        or None (a live piece queued twice, or being copied: its other queue entry writes it)."""
        if not piece.live:
            return WriteFrom.BUFFER
        with self._lock:
            if piece.state in (PieceState.QUEUED, PieceState.COPIED):
                mode = WriteFrom.LIVE if piece.state is PieceState.QUEUED else WriteFrom.BUFFER
                piece.state = PieceState.WRITING
                return mode
            return None

    def note_write_start(self) -> None:
        if self.t_write_start is None:
            self.t_write_start = time.perf_counter()

    # -- the guard and the confirmation ------------------------------------------------------------
    #
    # torch bumps a version only after the in-place kernel returns, so only a check on the mutating
    # thread after the copies is sound: the guard, save(), wait_staged(), wait() run it (``confirm``),
    # and the commit waits for it (Stage.CONFIRMED).

    def release_guard(self) -> None:
        """The step pre-hook, on the thread about to step: return once the step may change our tensors
        (its version check is ordered after that thread's in-place ops)."""
        t = time.perf_counter()
        self.wait_for(Stage.CPU_STAGED)
        if self.live_pieces and self._stage < Stage.READ:
            assert self.settle is not None
            self.settle(self)  # copy the live pieces no writer has reached yet...
        if not self.save_events or self.live_pieces:
            # ...and wait for the ones being written (on the host: a stream wait would not hold back CPU kernels).
            self.wait_for(Stage.READ)
            self.confirm()
        else:
            self.wait_for(Stage.COPIES_QUEUED)
            # CUDA: kernels queued from here on run after the copies (stream wait below): this check confirms.
            self._verify()
            if not self.failed:
                # GPU-side wait: the compute stream waits for the copies, the host does not block.
                for device, event in self.last_events.items():
                    torch.cuda.current_stream(device).wait_event(event)
        self.guard_wait_s += time.perf_counter() - t

    def confirm(self) -> bool:
        """Re-check the lazy tensors' versions on this thread once nothing reads them; True once confirmed
        (or failed, or verified by the guard). Never blocks."""
        stage = self._stage
        if stage is Stage.CONFIRMED or stage is Stage.VERIFIED:
            return True
        if stage < Stage.READ:
            return False
        return self._verify()

    def _verify(self) -> bool:
        """Check the versions on this thread (one that mutates the tensors), unless done already:
        reads over -> CONFIRMED; copies queued, still read (CUDA) -> VERIFIED."""
        with self._lock:
            stage = self._stage
            if stage is Stage.COPIES_QUEUED or stage is Stage.READ:
                err = self._stale(self.lazy)
                if err is not None and self.error is None:
                    self.error = err
                self._move(Stage.VERIFIED if stage is Stage.COPIES_QUEUED else Stage.CONFIRMED)
        _guard.discard(self)
        return True

    def reading_over(self) -> None:
        """The last reader is through (``Engine._finish_reading``): a failed or already verified save,
        or one with nothing lazy, needs no confirmation."""
        with self._lock:
            done = self.error is not None or self._stage is Stage.VERIFIED or not self.lazy
            self._move(Stage.CONFIRMED if done else Stage.READ)
        if self.failed:
            _guard.discard(self)

    def _settle_for_wait(self, timeout: float | None) -> None:
        """``handle.wait_staged()``: copy the live pieces no writer has started (if staging got that
        far), wait for the rest, and confirm on this thread (the caller may mutate after this)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.wait_for(Stage.CPU_STAGED, timeout) and self.live_pieces and self.settle is not None:
            self.settle(self)
        self._confirm_for_wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _confirm_for_wait(self, timeout: float | None) -> None:
        """``handle.wait()`` and the checkpointer's waits: confirm, on this thread, the saves committed before
        this one, in order, then this one (commits are in order, and the waiting thread may be the only
        one able to confirm them)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job in [*(self.ahead(self) if self.ahead is not None else ()), self]:
            if not job.wait_confirmable(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return
            job.confirm()

    def wait_confirmable(self, timeout: float | None) -> bool:
        """Block until nothing reads the tensors any more (READ: ``confirm`` can check them) or the
        job failed (nothing to confirm); False when ``timeout`` ran out first."""
        with self._lock:
            return self._changed.wait_for(lambda: self._stage >= Stage.READ or self.error is not None, timeout)

    # -- the file ---------------------------------------------------------------------------------

    def metadata_writes(self) -> list[tuple[int, bytes]]:
        """Every byte that is not tensor data, once all data is in: the layout's fixed bytes and
        those that depend on each source's CRC (combined here from its pieces' CRCs)."""
        crcs = {key: _combine(sorted(parts)) for key, parts in self._crcs.items()} if self.crc else None
        return [*self.layout.fixed_writes(), *self.layout.crc_writes(crcs)]

    def stats(self, t_done: float) -> SaveStats:
        write_s = max(self.t_written - (self.t_write_start or self.t_written), 1e-9)
        return SaveStats(
            path=self.handle.path,
            bytes=self.nbytes,
            file_bytes=self.file_bytes,
            blocked_s=self.t_returned - self.t0,
            staged_s=self.t_staged - self.t0,
            durable_s=t_done - self.t0,
            write_s=write_s,
            write_gbps=self.file_bytes / write_s / 1e9,
            guard_wait_s=self.guard_wait_s,
        )


def _combine(parts: list[tuple[int, int, int]]) -> int:
    """CRC of consecutive pieces given (file_offset, crc, nbytes) in file order."""
    crc = 0
    for _, part, n in parts:
        crc = crc32_combine(crc, part, n)
    return crc
