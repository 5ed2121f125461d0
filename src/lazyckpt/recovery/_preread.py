"""A local torch.save zip read into memory: records, storages read in parallel with their CRC32s,
and ``preread`` (a ``verify`` that keeps the storages for ``load()``). A ``FileSource`` belongs to
the call that opened it and is share-locked (``storage/spare.py``).
"""

from __future__ import annotations

import io
import os
import struct
import weakref
import zipfile
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from lazyckpt.errors import VerificationError
from lazyckpt.formats.crc import crc32, crc32_combine
from lazyckpt.recovery.verify import VerifyReport, verify_fd
from lazyckpt.storage import spare as _spare
from lazyckpt.threads import reentry

from . import _read
from ._read import FileIdentity

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header, 30 bytes


class Preread:
    """Storages of the file ``identity`` that ``latest()`` read while checking it, keyed by data
    offset. Owned by a ``Found``; findable by real path (``registered``) while it lives. ``take`` is
    one-shot across threads; a ``Found`` dropped unused frees them."""

    def __init__(self, path: str, identity: FileIdentity, storages: dict[int, torch.UntypedStorage]) -> None:
        self.identity = identity
        self._storages: dict[int, torch.UntypedStorage] | None = storages
        self._lock = reentry.Lock()
        _LIVE[os.path.realpath(path)] = self

    def take(self, identity: FileIdentity) -> dict[int, torch.UntypedStorage] | None:
        """The storages, once, when ``identity`` is the file they were read from; else None."""
        with self._lock:
            storages, self._storages = self._storages, None
        return storages if identity == self.identity else None

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(s.nbytes() for s in (self._storages or {}).values())

    def __reduce__(self) -> tuple[Any, tuple[()]]:
        """Pickled as nothing: the storages are this process's memory, never sent."""
        return _nothing, ()

    def moved(self, path: str) -> None:
        """The file read was renamed to ``path``: findable there if it is the same file (only its
        ctime changed)."""
        try:
            now = FileIdentity.at(path)
        except OSError:
            return
        was = self.identity
        if (now.dev, now.ino, now.size, now.mtime_ns) == (was.dev, was.ino, was.size, was.mtime_ns):
            self.identity = now
            _LIVE[os.path.realpath(path)] = self

    @classmethod
    def registered(cls, path: str) -> Preread | None:
        """The live ``Preread`` of the file at ``path`` (by real path), if any."""
        return _LIVE.get(os.path.realpath(path))

    @classmethod
    def release(cls, path: str) -> None:
        """Free what was read ahead for ``path``."""
        held = cls.registered(path)
        if held is not None:
            held.drop()

    def drop(self) -> None:
        """Free the storages (a ``take`` after this gets None)."""
        with self._lock:
            self._storages = None


_LIVE: weakref.WeakValueDictionary[str, Preread] = weakref.WeakValueDictionary()  # by real path


def _nothing() -> None:
    return None


class FileSource:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            _spare.share_lock(self.fd, path)  # a memory level's file: its pages are not reused meanwhile
        except BaseException:
            os.close(self.fd)
            raise
        self.size = os.fstat(self.fd).st_size

    def identity(self) -> _read.FileIdentity:
        return _read.FileIdentity.of(self.fd)

    def read_into(self, view: memoryview, offset: int) -> None:
        while view:
            n = os.preadv(self.fd, [view], offset)
            if n <= 0:
                raise VerificationError(f"file ended at byte {offset} while reading it (truncated meanwhile?)")
            view, offset = view[n:], offset + n

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Seekable(io.RawIOBase):
    """A readable, seekable raw file of ``size`` bytes; subclasses read at ``pos``."""

    pos = 0

    @property
    def size(self) -> int:
        raise NotImplementedError

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = offset if whence == 0 else self.pos + offset if whence == 1 else self.size + offset
        return self.pos


class ZipReader(Seekable):
    """A seekable file over ``source`` for ``zipfile`` (the central directory and local headers)."""

    def __init__(self, source: FileSource) -> None:
        self.source, self.pos = source, 0

    @property
    def size(self) -> int:
        return self.source.size

    def readinto(self, b: Any) -> int:
        n = max(0, min(len(b), self.source.size - self.pos))
        if n:
            self.source.read_into(memoryview(b).cast("B")[:n], self.pos)
            self.pos += n
        return n


def is_zip(source: FileSource) -> bool:
    if source.size < 4:
        return False
    head = bytearray(4)
    source.read_into(memoryview(head), 0)
    return bytes(head) == b"PK\x03\x04"


class ZipEntry:
    """One member of a torch.save zip as read back: its data span, CRC, and whether it is stored."""

    __slots__ = ("name", "start", "stop", "crc", "stored")

    def __init__(self, name: str, start: int, stop: int, crc: int, stored: bool) -> None:
        self.name, self.start, self.stop, self.crc, self.stored = name, start, stop, crc, stored


def records(source: FileSource, path: str) -> list[ZipEntry]:
    """Each record's data range and CRC, from the central directory and the local headers."""
    try:
        with zipfile.ZipFile(ZipReader(source)) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise VerificationError(f"{path}: not a readable zip file: {exc}") from exc
    out = []
    header = bytearray(_LOCAL_HEADER.size)
    for info in infos:
        if info.header_offset + len(header) > source.size:
            raise VerificationError(f"{path}: record {info.filename}: local header beyond the end of the file")
        source.read_into(memoryview(header), info.header_offset)
        sig, *_, name_len, extra_len = _LOCAL_HEADER.unpack(header)
        if sig != b"PK\x03\x04":
            raise VerificationError(f"{path}: record {info.filename}: bad local header")
        start = info.header_offset + len(header) + name_len + extra_len
        stop = start + info.compress_size
        if stop > source.size:
            raise VerificationError(f"{path}: record {info.filename}: data runs past the end of the file (truncated)")
        out.append(ZipEntry(info.filename, start, stop, info.CRC, info.compress_type == zipfile.ZIP_STORED))
    return out


def check_crc(path: str, record: ZipEntry, value: int) -> None:
    if value != record.crc:
        raise VerificationError(
            f"{path}: record {record.name}: CRC32 {value:08x}, the zip says {record.crc:08x} (corrupt data)"
        )


def check_compressed(source: FileSource, path: str) -> None:
    """Check compressed records' CRCs through ``zipfile``."""
    with zipfile.ZipFile(ZipReader(source)) as zf:
        bad = zf.testzip()
    if bad is not None:
        raise VerificationError(f"{path}: record {bad}: CRC mismatch")


def data_records(all_records: list[ZipEntry]) -> list[ZipEntry]:
    """The stored storage records (``<archive>/data/<key>``)."""
    return [r for r in all_records if r.stored and "/data/" in f"/{r.name}"]


def read_storages(
    source: FileSource, data: list[ZipEntry], threads: int, piece: int, crc: bool
) -> tuple[dict[int, torch.UntypedStorage], list[int] | None]:
    """Each record of ``data`` into a host allocation of its own ({data offset: storage}), read by
    ``threads`` threads in ``piece``-byte pieces; with ``crc``, each record's CRC32 (else None)."""
    storages = {r.start: torch.empty(r.stop - r.start, dtype=torch.uint8).untyped_storage() for r in data}
    views = {r.start: writable(storages[r.start]) for r in data}
    tasks = [(i, a, min(r.stop, a + piece)) for i, r in enumerate(data) for a in range(r.start, r.stop, piece)]

    def read(task: tuple[int, int, int]) -> tuple[int, int, int]:
        i, a, b = task
        start = data[i].start
        view = views[start][a - start : b - start]
        source.read_into(view, a)
        return i, b - a, crc32(view) if crc else 0

    if threads > 1 and len(tasks) > 1:
        with ThreadPoolExecutor(max_workers=min(threads, len(tasks)), thread_name_prefix="lazyckpt-read") as ex:
            parts = list(ex.map(read, tasks))
    else:
        parts = [read(t) for t in tasks]
    if not crc:
        return storages, None
    crcs = [0] * len(data)
    for i, nbytes, value in parts:  # in file order within each record
        crcs[i] = crc32_combine(crcs[i], value, nbytes)
    return storages, crcs


def preread(path: str, threads: int, piece: int = _read.PIECE_BYTES) -> tuple[VerifyReport, Preread | None]:
    """``lazyckpt.verify(path)`` of a local file, reading a torch zip's storages on the way: (the
    report, a ``Preread`` of them when the file passed, else None)."""
    with FileSource(path) as source:
        held: dict[int, torch.UntypedStorage] = {}

        def known(_map: Any) -> dict[tuple[int, int], int]:
            try:
                data = data_records(records(source, path))
                storages, crcs = read_storages(source, data, _read.readers(path, threads), piece, crc=True)
            except (VerificationError, OSError):  # damaged or shrunk: the structure check says how
                return {}
            held.update(storages)
            return {(r.start, r.stop): value for r, value in zip(data, crcs or [], strict=True)}

        report = verify_fd(source.fd, path, known)
    if report.ok and report.identity is not None and held:
        return report, Preread(path, report.identity, held)
    return report, None


def check_small(source: FileSource, rest: list[ZipEntry], path: str) -> None:
    """The CRCs of the small records (``data.pkl``, ``version``, ``byteorder``), read one by one."""
    for r in rest:
        if not r.stored:
            check_compressed(source, path)
            continue
        buf = bytearray(r.stop - r.start)
        source.read_into(memoryview(buf), r.start)
        check_crc(path, r, crc32(buf))


def writable(storage: torch.UntypedStorage) -> memoryview:
    """A writable view of a CPU storage's bytes (its memory stays owned by the storage)."""
    import ctypes

    n = storage.nbytes()
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(storage.data_ptr())).cast("B")
