"""Job: one save on its way from staging to commit, and the pieces it is cut into.

A job is created by ``save()`` and then touched by the stager, the writers and the committer; all
mutable state is behind ``_lock``. The first error wins and turns every later step into cleanup.
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from lazyckpt.core import guard as _guard
from lazyckpt.core.handle import Completion, SaveStats
from lazyckpt.core.pool import Buffer
from lazyckpt.errors import StaleTensorError
from lazyckpt.formats.base import Layout
from lazyckpt.formats.crc import crc32_combine
from lazyckpt.formats.flatten import Source


class PieceState(enum.Enum):
    """Where a live piece is; a staged (non-live) piece is always QUEUED until a writer takes it.

    Live pieces go QUEUED -> WRITING (a writer reads the tensor's own memory), or
    QUEUED -> CLAIMED -> COPIED -> WRITING (the guard copied it to a buffer before the step).
    """

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
        self.fd = -1
        self.dfd = -1  # O_DIRECT descriptor of the same file, when used
        # The temporary file is created by whichever thread first needs it (Engine.open: a writer,
        # or save() itself on a memory filesystem), never blocking the caller on the journal.
        self.direct = False  # open an O_DIRECT descriptor too
        self.open_lock = threading.Lock()
        self.opened = False
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._outstanding = 0
        self._all_submitted = False
        self._crcs: dict[str, list[tuple[int, int, int]]] = {}
        self.written = threading.Event()  # file complete on disk (or failed), fd closed
        self.cpu_staged = threading.Event()  # lazy CPU sources copied
        self.enqueued = threading.Event()  # lazy CUDA copies queued on the copy stream
        self.save_events: dict[torch.device, Any] = {}  # compute-stream events recorded in save()
        self.last_events: dict[torch.device, Any] = {}  # last copy-stream event per device
        self.version_lock = threading.Lock()
        # Soundness of the _version check: torch bumps a tensor's version only after the in-place
        # kernel returns, so a check on a lazyckpt thread can pass while an op that overlapped the
        # copy is still running. Only a check on the mutating thread, after the copy is over, is
        # ordered after that thread's ops. ``verified``: such a check passed (the guard, save(),
        # wait_staged(), wait() run it: ``confirm``); ``confirmed``: the commit may go ahead.
        self.verified = False
        self.confirmed = threading.Event()
        if not lazy:  # everything was captured inside save(), on the caller's thread
            self.verified = True
            self.confirmed.set()
        self.t0 = t0
        self.t_returned = t0
        self.t_staged = t0
        self.t_write_start: float | None = None
        self.t_written = t0
        self.guard_wait_s = 0.0
        # Readers of live memory: the stager until it is through, plus each live piece until it is
        # written or copied. The last one out checks versions and releases the guard (read_done).
        self._readers = 1
        self.live_pieces: list[Piece] = []
        self.read_done = threading.Event()
        self.settle: Callable[[Job], None] | None = None  # Engine.settle: copy what is not written yet
        self.completion.bind(settle=self._settle_for_wait, confirm=self._confirm_for_wait)

    # -- errors -----------------------------------------------------------------------------------

    @property
    def failed(self) -> bool:
        return self.error is not None

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc

    def check_stale(self, sources: list[Source]) -> None:
        for src in sources:
            name = src.first_stale()
            if name is not None:
                self.fail(
                    StaleTensorError(
                        f"save to {self.path} abandoned: tensor {name!r} was modified in place before its copy "
                        "was complete, so the file would have mixed two training states. Mutate saved tensors "
                        "only after handle.wait_staged() (optimizer steps wait automatically).",
                        path=self.path,
                        tensor_name=name,
                    )
                )
                return

    # -- pieces -----------------------------------------------------------------------------------

    def piece_added(self) -> None:
        with self._lock:
            self._outstanding += 1

    def piece_written(self, piece: Piece, crc: int) -> None:
        with self._lock:
            self._crcs.setdefault(piece.source.key, []).append((piece.file_offset, crc, piece.nbytes))

    def piece_done(self) -> bool:
        """Count a finished piece; True when the job is ready to finalise."""
        with self._lock:
            self._outstanding -= 1
            return self._all_submitted and self._outstanding == 0

    def all_submitted(self) -> bool:
        with self._lock:
            self._all_submitted = True
            return self._outstanding == 0

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

    # -- the guard --------------------------------------------------------------------------------

    def release_guard(self) -> None:
        """Called by the optimizer step pre-hook: return once the step may change our tensors.

        Runs on the thread about to step, so its version check is ordered after every in-place op
        that thread issued before the step (``confirm``)."""
        t = time.perf_counter()
        self.cpu_staged.wait()
        if self.live_pieces and not self.read_done.is_set():
            assert self.settle is not None
            self.settle(self)  # copy the live pieces no writer has reached yet...
        if not self.save_events:
            self.read_done.wait()  # ...and wait for the ones being written
            self.confirm()
        else:
            self.enqueued.wait()
            # CUDA: versions are bumped when a kernel is queued, and every kernel queued from here
            # on runs after the copies (the stream wait below), so this check confirms the save.
            self._verify(read_over=False)
            if not self.failed:
                # GPU-side wait: the compute stream waits for the copies, the host does not block.
                for device, event in self.last_events.items():
                    torch.cuda.current_stream(device).wait_event(event)
        self.guard_wait_s += time.perf_counter() - t

    def confirm(self) -> bool:
        """Re-check the lazy tensors' versions on the calling thread once nothing reads them any
        more; True once the save is confirmed (or failed). Never blocks on staging."""
        if self.verified or not self.read_done.is_set():
            return self.verified
        return self._verify(read_over=True)

    def _verify(self, read_over: bool) -> bool:
        with self.version_lock:
            if not self.verified:
                self.check_stale(self.lazy)
                self.verified = True
            if read_over or self.read_done.is_set():
                self.confirmed.set()
                for src in self.lazy:
                    src.release()
        _guard.discard(self)
        return True

    def reading_over(self) -> None:
        """The last reader is through (``Engine._finish_reading``): a failed or already verified save
        needs no confirmation."""
        with self.version_lock:
            self.read_done.set()
            if self.failed or self.verified:
                self.confirmed.set()
                for src in self.lazy:
                    src.release()
        if self.failed:
            _guard.discard(self)

    def _settle_for_wait(self, timeout: float | None) -> None:
        """``handle.wait_staged()``: copy the live pieces no writer has started (if staging got that
        far), wait for the rest, and confirm on this thread (the caller may mutate after this)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.cpu_staged.wait(timeout) and self.live_pieces and self.settle is not None:
            self.settle(self)
        self._confirm_for_wait(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def _confirm_for_wait(self, timeout: float | None) -> None:
        """``handle.wait()`` and the checkpointer's waits: the commit waits for a confirmation."""
        if self.read_done.wait(timeout):
            self.confirm()

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
