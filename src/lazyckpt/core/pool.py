"""HostBufferPool: bounded host memory for staging, in chunks allocated lazily up to the budget and reused.

Pinned chunks are our own anonymous memory registered with ``cudaHostRegister`` (not torch's caching host
allocator, which rounds up and keeps blocks); ``close()`` unregisters them. Pieces are bump-allocated in
the current chunk, which is free again once every piece in it is released. ``alloc`` blocks while the
budget is used up: saves that outrun storage slow down to storage speed.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time

import torch

from lazyckpt.storage.fs import PAGE
from lazyckpt.threads import reentry

logger = logging.getLogger(__name__)

_ALIGN = 64


_HUGE = 2 << 20


def _anonymous(nbytes: int) -> torch.Tensor:
    """Private anonymous memory asking for transparent huge pages (fewer TLB misses and O_DIRECT pins;
    a shared mapping would be shmem, which gets no THP)."""
    mem = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mem.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # pragma: no cover - kernels without THP
            pass
    return torch.frombuffer(mem, dtype=torch.uint8)  # the tensor keeps ``mem`` alive


_HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: pinned for every CUDA context, not one device's


def _register(addr: int, nbytes: int) -> None:
    code = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, _HOST_REGISTER_PORTABLE))
    if code != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {torch.cuda.CudaError(code)}")


def _unregister(addr: int) -> None:
    code = int(torch.cuda.cudart().cudaHostUnregister(addr))
    if code != 0:  # close() must go on; the memory is freed with its mapping anyway
        logger.warning("lazyckpt: cudaHostUnregister failed: %s", torch.cuda.CudaError(code))


class _Chunk:
    __slots__ = ("tensor", "size", "used", "live")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.size = tensor.numel()
        self.used = 0  # bump pointer
        self.live = 0  # pieces not yet released


class Buffer:
    """A piece of a chunk: ``view`` is a 1-D uint8 tensor of exactly ``nbytes``."""

    __slots__ = ("chunk", "view", "nbytes")

    def __init__(self, chunk: _Chunk, start: int, nbytes: int) -> None:
        self.chunk = chunk
        self.view = chunk.tensor[start : start + nbytes]
        self.nbytes = nbytes

    def memoryview(self) -> memoryview:
        """Zero-copy view for os.pwrite / crc32 (the chunk stays alive while the Buffer does)."""
        if self.nbytes == 0:
            return memoryview(b"")
        arr = (ctypes.c_char * self.nbytes).from_address(self.view.data_ptr())
        return memoryview(arr).cast("B")


class HostBufferPool:
    """Bounded, reusable host memory. Thread-safe; ``alloc`` may block, ``release`` never does."""

    def __init__(self, budget_bytes: int, chunk_bytes: int, pin_memory: bool) -> None:
        self.chunk_bytes = max(PAGE, min(chunk_bytes, budget_bytes) // PAGE * PAGE)
        self.max_chunks = max(1, budget_bytes // self.chunk_bytes)
        self.pin_memory = pin_memory
        # The training thread's CUDA device, set by the first save (``Producer.run_job``): chunks are
        # registered under it, not under a lazyckpt thread's default device 0.
        self.pin_device: int | None = None
        self._cond = reentry.condition()
        self._chunks: list[_Chunk] = []
        self._free: list[_Chunk] = []
        self._current: _Chunk | None = None
        self._closed = False
        self.wait_s = 0.0  # total time alloc() blocked on a full budget

    @property
    def capacity_bytes(self) -> int:
        return self.max_chunks * self.chunk_bytes

    @property
    def allocated_bytes(self) -> int:
        return len(self._chunks) * self.chunk_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes of host memory this pool holds pinned (registered with CUDA) right now."""
        return self.allocated_bytes if self.pin_memory else 0

    def alloc(self, nbytes: int, phase: int = 0) -> Buffer:
        """A buffer of ``nbytes``, blocking while the budget is used up. One of at least a page starts
        ``phase`` bytes after a page boundary (``phase < PAGE``, ``phase + nbytes <= chunk_bytes``), so its
        address can share its file offset's page phase (for O_DIRECT)."""
        if nbytes < PAGE:
            phase, align = 0, _ALIGN  # small pieces are written buffered: no phase needed
        else:
            align = PAGE
            if not 0 <= phase < PAGE:
                raise ValueError(f"phase {phase} is not within a page of {PAGE} bytes")
        if phase + nbytes > self.chunk_bytes:
            raise ValueError(f"piece of {nbytes} bytes at phase {phase} exceeds the chunk size {self.chunk_bytes}")
        with self._cond:
            while True:
                if self._closed:
                    raise RuntimeError("host buffer pool is closed")
                cur = self._current
                if cur is not None:
                    start = -(-cur.used // align) * align + phase
                    if start + nbytes <= cur.size:
                        cur.used = start + nbytes
                        cur.live += 1
                        return Buffer(cur, start, nbytes)
                self._retire_current()
                if self._free:
                    self._current = self._free.pop()
                elif len(self._chunks) < self.max_chunks:
                    self._current = self._new_chunk()
                else:
                    w0 = time.perf_counter()
                    self._cond.wait()
                    self.wait_s += time.perf_counter() - w0

    def _retire_current(self) -> None:
        cur = self._current
        self._current = None
        if cur is not None and cur.live == 0:
            cur.used = 0
            self._free.append(cur)

    def _new_chunk(self) -> _Chunk:
        raw = _anonymous(self.chunk_bytes + _HUGE)
        skip = (-raw.data_ptr()) % _HUGE
        tensor = raw[skip : skip + self.chunk_bytes]  # aligned (the slice keeps ``raw`` alive)
        if self.pin_memory:
            if self.pin_device is None:
                _register(tensor.data_ptr(), self.chunk_bytes)  # faults the pages in as it pins them
            else:
                with torch.cuda.device(self.pin_device):
                    _register(tensor.data_ptr(), self.chunk_bytes)
        # Unpinned chunks are not touched here: pages fault in at the first copy and stay mapped, so the
        # first piece (maybe on the training thread) does not pay for the whole chunk.
        chunk = _Chunk(tensor)
        self._chunks.append(chunk)
        return chunk

    def release(self, buf: Buffer) -> None:
        chunk = buf.chunk
        with self._cond:
            chunk.live -= 1
            if chunk.live == 0 and chunk is not self._current:
                chunk.used = 0
                self._free.append(chunk)
                self._cond.notify_all()

    def close(self) -> None:
        """Drop every chunk (callers must have released their buffers); unpin pinned ones."""
        with self._cond:
            self._closed = True
            if self.pin_memory:
                for chunk in self._chunks:
                    if self.pin_device is None:
                        _unregister(chunk.tensor.data_ptr())
                    else:
                        with torch.cuda.device(self.pin_device):
                            _unregister(chunk.tensor.data_ptr())
            self._chunks.clear()
            self._free.clear()
            self._current = None
            self._cond.notify_all()


def default_host_memory_budget() -> int:
    """A quarter of physical memory, at most 16 GiB."""
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        total = 8 << 30
    return int(min(total // 4, 16 << 30))
