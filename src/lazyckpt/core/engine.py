"""The engine: the staging thread, the writer pool and the committer, and the queues between them.

Ownership: the stager owns the copy streams and takes buffers from the pool; a writer owns a
piece from the moment it is queued until its buffer is back in the pool; the job's last piece
queues a finalisation (headers, fsync, close) on a writer; the committer owns the rename, runs jobs
strictly in save() order (so the last save to a path wins) and is the only one to finish handles.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from lazyckpt.core.committer import Committer, write_error
from lazyckpt.core.job import FileState, Job, Piece, PieceState, Stage, WriteFrom
from lazyckpt.core.pool import PAGE, HostBufferPool
from lazyckpt.errors import WriteError
from lazyckpt.formats.capture import Source
from lazyckpt.formats.crc import crc32
from lazyckpt.storage import fs as _fs
from lazyckpt.storage.spare import Spares
from lazyckpt.threads.workers import Worker

logger = logging.getLogger(__name__)

_LIVE_PIECE = 8 << 20  # a live piece: short enough that an optimizer step rarely waits for one in flight
_CRC_SLICE = 1 << 20  # CRC32 then write this much at a time: the write's copy reads it from cache
_GATHER_MAX = 256 << 10  # sources written inside save() up to this size are gathered, a run at a time,
_GATHER_RUN = 4 << 20  # into one buffer of at most this much (one pwrite instead of one per tensor)


def write_buffered(fd: int, data: memoryview, offset: int, crc: bool) -> int:
    """``pwrite`` ``data`` at ``offset``; with ``crc``, return its CRC32, computed slice by slice just
    before each slice is written so the write reads it from cache (one pass over memory)."""
    if not crc:
        _fs.pwrite_all(fd, data, offset)
        return 0
    value = 0
    for start in range(0, len(data), _CRC_SLICE):
        part = data[start : start + _CRC_SLICE]
        value = crc32(part, value)
        _fs.pwrite_all(fd, part, offset + start)
    return value


def memory_at(addr: int, nbytes: int) -> memoryview:
    """A writable-buffer view of ``nbytes`` at ``addr`` (the caller keeps the memory alive)."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B")


def _item_failed(item: Job | Piece | _Call, exc: BaseException) -> None:
    """A worker's unexpected error fails that item's job (a call: its future), never the thread."""
    if isinstance(item, _Call):
        if not item.future.done():
            item.future.set_exception(exc)
        return
    job = item if isinstance(item, Job) else item.job
    logger.error("lazyckpt: %s failed unexpectedly for %s", threading.current_thread().name, job.path, exc_info=exc)
    job.fail(write_error(job, "processing", exc))


class _Call:
    """A function for a writer thread (``Engine.run``) and the future of its result."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.fn = fn
        self.future: Future = Future()

    def __call__(self) -> None:
        if not self.future.set_running_or_notify_cancel():
            return
        try:
            result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - the future carries it
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)


def _new_event() -> torch.cuda.Event:
    """Blocking events: a thread in ``synchronize()`` sleeps instead of spinning a core."""
    return torch.cuda.Event(blocking=True)


class Engine:
    def __init__(self, pool: HostBufferPool, writer_threads: int, on_done: Callable[[Job], None]) -> None:
        self.pool = pool
        self.spares = Spares()  # files memory levels' retention dropped, for the next saves there
        self._copy_streams: dict[torch.device, torch.cuda.Stream] = {}
        self._stager: Worker[Job] = Worker("lazyckpt-stager", self._stage, on_error=_item_failed)
        self._writers: Worker[Piece | Job | _Call] = Worker(
            "lazyckpt-writer", self._write_item, threads=writer_threads, numbered=True, on_error=_item_failed
        )
        # A memory filesystem's files (``Job.serial``) get one writer thread of their own: the kernel
        # serialises writes to a tmpfs file on its inode lock, so more writers only take the training's core.
        self._serial_writer: Worker[Piece | Job | _Call] = Worker(
            "lazyckpt-writer-memory", self._write_item, lazy=True, on_error=_item_failed
        )
        self.committer = Committer(on_done)
        self._stopped = False

    # -- called from save() -----------------------------------------------------------------------

    def submit(self, job: Job) -> None:
        """Queue a job whose file is open and whose eager sources are staged."""
        job.settle, job.ahead = self.settle, self.committer.ahead
        self.committer.submit(job)
        self._stager.submit(job)

    def _queue_write(self, item: Piece | Job) -> None:
        """Hand a piece (or a job to finalise) to its writer: a memory filesystem's file to the one
        memory writer, any other to the pool (also when the memory writer cannot start)."""
        job = item if isinstance(item, Job) else item.job
        if job.serial is None or not self._serial_writer.submit(item):
            self._writers.submit(item)

    def open(self, job: Job) -> bool:
        """Create the job's temporary file (or reuse a spare, ``storage/spare.py``) and reserve its size,
        unless done; True when it is open. Runs on the first thread that needs the file: a writer, so
        ``save()`` never waits on the filesystem, or ``save()`` for an inline save. A failure fails the
        job (``WriteError``, errno kept) before any byte is written."""
        if job.file is not FileState.NEW:
            return job.fd >= 0
        with job.open_lock:
            if job.file is FileState.NEW:
                try:
                    if not job.failed:
                        job.fd = self.spares.take(job.path, job.tmp, job.file_bytes)
                        if job.fd < 0:
                            job.fd = _fs.open_temporary(job.tmp, job.file_bytes)
                        if job.direct:
                            job.dfd = _fs.open_direct(job.tmp)
                except Exception as exc:
                    code = getattr(exc, "errno", None)
                    err = WriteError(f"cannot create {job.tmp}: {exc}", path=job.path, errno=code)
                    err.__cause__ = exc
                    job.fail(err)
                finally:
                    job.reach(FileState.OPEN)
        return job.fd >= 0

    def stage_now(self, job: Job, src: Source) -> None:
        """Capture a source on the caller's thread (tensors no optimizer guards); CUDA copies go on the
        current stream, ordered before any kernel queued after ``save()``."""
        stream = torch.cuda.current_stream(src.device) if src.device.type == "cuda" else None
        self._copy_source(job, src, stream)

    def write_now(self, job: Job, src: Source) -> None:
        """Write a CPU source on the caller's thread straight from its memory (``plan.write_in_save``);
        counted like any piece, so the job finalises and commits in the background."""
        self.open(job)
        for piece in self._pieces(job, src):
            if job.failed:
                return
            job.piece_added()
            try:
                data = memory_at(src.data_ptr + piece.start, piece.nbytes)
                job.note_write_start()
                crc = write_buffered(job.fd, data, piece.file_offset, job.crc)
                job.piece_written(piece, crc)
            except Exception as exc:
                job.fail(write_error(job, "writing", exc))
            finally:  # never True here: the stager marks the job fully submitted only after save()
                job.piece_done()

    def write_now_all(self, job: Job, sources: list[Source]) -> None:
        """``write_now`` for every source of ``sources``: runs of small ones adjacent in the file are
        gathered into one buffer and written with one ``pwrite``; a large one as ``write_now`` does."""
        mine = {id(s) for s in sources}
        run: list[Source] = []
        run_bytes = 0
        for src in sorted(job.sources, key=lambda s: s.file_offset):
            if id(src) not in mine or src.nbytes > _GATHER_MAX or run_bytes + src.nbytes > _GATHER_RUN:
                self._write_run(job, run)
                run, run_bytes = [], 0
                if id(src) in mine:
                    if src.nbytes > _GATHER_MAX:
                        self.write_now(job, src)
                    else:
                        run, run_bytes = [src], src.nbytes
                continue
            run.append(src)
            run_bytes += src.nbytes
        self._write_run(job, run)

    def _write_run(self, job: Job, run: list[Source]) -> None:
        if len(run) < 2:
            for src in run:
                self.write_now(job, src)
            return
        self.open(job)
        pieces = [p for src in run for p in self._pieces(job, src)]
        if job.failed or not pieces:
            return
        try:
            lo = pieces[0].file_offset
            buf = bytearray(pieces[-1].file_offset + pieces[-1].nbytes - lo)
            written = []
            for piece in pieces:
                data = memory_at(piece.source.data_ptr + piece.start, piece.nbytes)
                at = piece.file_offset - lo
                buf[at : at + piece.nbytes] = data
                written.append((piece, crc32(data) if job.crc else 0))
            job.note_write_start()
            _fs.pwrite_all(job.fd, memoryview(buf), lo)
            job.pieces_written(written)  # (save() holds the stager's count: no finalisation before this)
        except Exception as exc:
            job.fail(write_error(job, "writing", exc))

    def _pieces(self, job: Job, src: Source, step: int = 0) -> list[Piece]:
        """Cut a source where its file offset crosses a multiple of ``step`` (default: the chunk
        size), so that each piece fits a chunk at its in-page phase (see ``HostBufferPool.alloc``)."""
        step = step or self.pool.chunk_bytes
        pieces, a = [], 0
        while a < src.nbytes:
            n = min(step - (src.file_offset + a) % step, src.nbytes - a)
            pieces.append(Piece(job, src, a, n))
            a += n
        return pieces

    # -- staging ----------------------------------------------------------------------------------

    def _stage(self, job: Job) -> None:
        cpu = [s for s in job.lazy if s.device.type != "cuda"]
        cuda = [s for s in job.lazy if s.device.type == "cuda"]
        try:
            for src in cpu:
                if src.live:
                    self._queue_live(job, src)
                    continue
                self._copy_source(job, src, stream=None)
                job.check_stale([src])
            job.reach(Stage.CPU_STAGED)
            # Each CUDA call under its device: this thread's current device is 0, and a call there
            # would create a context on GPU 0 for a tensor on another GPU.
            for device, event in job.save_events.items():
                with torch.cuda.device(device):
                    self._copy_stream(device).wait_event(event)
            for src in cuda:
                with torch.cuda.device(src.device):
                    self._copy_source(job, src, stream=self._copy_stream(src.device))
            job.reach(Stage.COPIES_QUEUED)
            for device, event in job.last_events.items():
                with torch.cuda.device(device):
                    event.synchronize()
            job.check_early(cuda)
        except BaseException as exc:
            job.fail(write_error(job, "staging for", exc))
        finally:
            job.reach(Stage.CPU_STAGED)
            job.reach(Stage.COPIES_QUEUED)
            if job.reader_done():
                self._finish_reading(job)
            if job.all_submitted():
                self._queue_write(job)

    def _queue_live(self, job: Job, src: Source) -> None:
        """Queue a CPU source to be written straight from its memory (no staging copy). A step or
        ``wait_staged()`` before the writers copies what they have not started (``settle``); pieces
        are small so that waiting for those in flight stays short."""
        for piece in self._pieces(job, src, min(_LIVE_PIECE, self.pool.chunk_bytes)):
            piece.live = True
            job.add_live(piece)
            self._queue_write(piece)

    def settle(self, job: Job) -> None:
        """Copy every live piece of ``job`` that no writer has started into a pool buffer, on the calling
        (training) thread, and queue it again. Blocks while the pool's budget is used up."""
        claimed = job.claim_live()
        # Every claimed piece must come out copied, counted and requeued even on Ctrl-C, or the job hangs.
        try:
            for piece in claimed:
                try:
                    if not job.failed:
                        piece.buffer = self.pool.alloc(piece.nbytes, piece.file_offset % PAGE)
                        ctypes.memmove(piece.buffer.view.data_ptr(), piece.source.data_ptr + piece.start, piece.nbytes)
                except Exception as exc:
                    job.fail(write_error(job, "staging for", exc))
                self._requeue(job, piece)
        except BaseException as exc:  # KeyboardInterrupt, SystemExit: fail the save, finish, re-raise
            job.fail(write_error(job, "staging for", exc))
            for piece in claimed:
                if piece.state is PieceState.CLAIMED:
                    self._requeue(job, piece)
            raise

    def _requeue(self, job: Job, piece: Piece) -> None:
        """A claimed piece is copied (or given up): count its reader out, queue it for a writer."""
        try:
            if job.copied(piece):
                self._finish_reading(job)
        finally:
            self._queue_write(piece)

    @staticmethod
    def _finish_reading(job: Job) -> None:
        """The last reader of live memory is through: an early stale check (the sound one is
        ``Job.confirm``), drop the references to unguarded tensors, let the optimizer step."""
        try:
            if job.live_pieces:
                job.check_stale([s for s in job.lazy if s.live])
            lazy = {id(s) for s in job.lazy}
            for src in job.sources:  # every copy has landed or is ordered on the compute stream
                if id(src) not in lazy:  # lazy ones keep their version checks until confirmed
                    src.release()
            job.t_staged = time.perf_counter()
        finally:
            job.completion.staged()
            job.reading_over()

    def _copy_source(self, job: Job, src: Source, stream: torch.cuda.Stream | None) -> None:
        """Copy a source piece by piece into pool buffers and queue each piece for writing."""
        for piece in self._pieces(job, src):
            if job.failed:
                return
            piece.buffer = self.pool.alloc(piece.nbytes, piece.file_offset % PAGE)
            job.piece_added()
            try:
                self._copy_piece(job, src, piece, stream)
            finally:  # even on Ctrl-C: a writer returns the buffer (the job has failed by then)
                self._queue_write(piece)

    def _copy_piece(self, job: Job, src: Source, piece: Piece, stream: torch.cuda.Stream | None) -> None:
        assert piece.buffer is not None
        if stream is None and src.device.type == "cpu":
            # One memcpy with the GIL released: torch's copy_ would take every intra-op thread from training.
            ctypes.memmove(piece.buffer.view.data_ptr(), src.data_ptr + piece.start, piece.nbytes)
            return
        view = src.flat[piece.start : piece.start + piece.nbytes]
        if stream is None:
            piece.buffer.view.copy_(view)
            return
        with torch.cuda.stream(stream):
            piece.buffer.view.copy_(view, non_blocking=True)
            piece.event = _new_event()
            piece.event.record(stream)
        job.last_events[src.device] = piece.event

    def _copy_stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._copy_streams.get(device)
        if stream is None:
            stream = self._copy_streams[device] = torch.cuda.Stream(device)
        return stream

    # -- writing ----------------------------------------------------------------------------------

    def run(self, fn: Callable[[], object]) -> Future:
        """Run ``fn`` on a writer thread behind the pieces already queued (an integration's fsyncs); return
        its future. Runs inline when no writer thread runs."""
        call = _Call(fn)
        if not self._writers.submit(call):
            call()
        return call.future

    def _write_item(self, item: Piece | Job | _Call) -> None:
        if isinstance(item, _Call):
            item()
            return
        if not isinstance(item, Job):
            self._write_piece(item)
            return
        try:
            self._finalize(item)
        except BaseException as exc:  # noqa: BLE001 - failed first, then WRITTEN: the committer
            _item_failed(item, exc)  # waits for WRITTEN, then discards the failed file
            item.reach(FileState.WRITTEN)

    def _write_piece(self, piece: Piece) -> None:
        job = piece.job
        mode = job.take(piece)
        if mode is None:
            return
        try:
            if piece.event is not None:
                with torch.cuda.device(piece.source.device):  # not a stray context on GPU 0
                    piece.event.synchronize()
            if self.open(job) and not job.failed:
                if mode is WriteFrom.LIVE:
                    addr = piece.source.data_ptr + piece.start
                    data = memory_at(addr, piece.nbytes)
                else:
                    assert piece.buffer is not None
                    addr, data = piece.buffer.view.data_ptr(), piece.buffer.memoryview()
                with job.serial or contextlib.nullcontext():
                    job.note_write_start()
                    crc = self._write_data(job, piece, data, addr)
                job.piece_written(piece, crc)
        except BaseException as exc:
            job.fail(write_error(job, "writing", exc))
        finally:
            piece.event = None
            if piece.buffer is not None:
                self.pool.release(piece.buffer)
                piece.buffer = None
            if mode is WriteFrom.LIVE and job.reader_done():
                self._finish_reading(job)
            if job.piece_done():
                self._queue_write(job)

    @staticmethod
    def _write_data(job: Job, piece: Piece, data: memoryview, addr: int) -> int:
        """Write one piece; return its CRC32 (0 without ``job.crc``). Whole pages go through O_DIRECT, the
        partial pages at either end buffered; the two never touch the same page. ``addr`` (where ``data``
        lives) must share the file offset's position within a page for O_DIRECT."""
        offset = piece.file_offset
        head = -offset % PAGE  # bytes up to the first page boundary in the file (and in memory)
        end = (offset + piece.nbytes) // PAGE * PAGE - offset  # up to the last one
        if job.dfd >= 0 and end > head and (addr - offset) % PAGE == 0:
            crc = crc32(data) if job.crc else 0  # the device reads the pages: no copy to share a pass with
            if head:
                _fs.pwrite_all(job.fd, data[:head], offset)
            try:
                _fs.pwrite_all(job.dfd, data[head:end], offset + head)
            except OSError as exc:
                # Refused (EINVAL, EFAULT for pinned memory, EOPNOTSUPP): the buffered write raises a real error.
                logger.debug("lazyckpt: O_DIRECT write to %s refused (%s); writing buffered", job.tmp, exc)
                _fs.pwrite_all(job.fd, data[head:end], offset + head)
            if end < piece.nbytes:
                _fs.pwrite_all(job.fd, data[end:], offset + end)
            return crc
        return write_buffered(job.fd, data, offset, job.crc)

    def _finalize(self, job: Job) -> None:
        # Every piece is written; the reader of the last live piece may still be checking versions.
        job.wait_for(Stage.READ)
        try:
            if self.open(job) and not job.failed:  # a job without tensor data opens it here
                for offset, data in job.metadata_writes():
                    _fs.pwrite_all(job.fd, data, offset)
                if job.fsync:
                    _fs.fsync(job.fd)
        except BaseException as exc:
            job.fail(write_error(job, "writing", exc))
        finally:
            job.t_written = time.perf_counter()
            for fd in (job.dfd, job.fd):
                if fd < 0:
                    continue
                try:
                    _fs.close(fd)
                except OSError as exc:  # a failed close can mean lost data (NFS): fail the save
                    job.fail(write_error(job, "closing", exc))
            job.reach(FileState.WRITTEN)

    def owns_current_thread(self) -> bool:
        """True on one of this engine's threads (the callback thread included)."""
        workers = (self._stager, self._writers, self._serial_writer)
        return any(w.owns_current_thread() for w in workers) or self.committer.owns_current_thread()

    # -- shutdown ---------------------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every thread (after the queues drain) and join them (not the callback thread when
        called from a callback: it ends after that callback)."""
        if self._stopped:
            self.committer.callbacks.stop()
            return
        self._stopped = True
        self._stager.stop()  # first: it queues pieces for the writers
        self._writers.stop()
        self._serial_writer.stop()
        self.committer.stop()
