"""``load()``: a torch.save file read in parallel, every record's CRC32 checked, unpickled by torch.

A local zip's storages are read straight into their own allocations; a URL into one host buffer. A
``Found`` verified or preread by ``latest()`` is not checked or read again for the same file. The
threads, buffers and (share-locked) descriptor belong to the call.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lazyckpt.core import remote as _remote
from lazyckpt.errors import VerificationError
from lazyckpt.storage import fs as _fs
from lazyckpt.storage import spare as _spare

from . import _preread, _read
from ._found import Found
from ._preread import FileSource, Preread, Seekable, ZipEntry, check_compressed, check_crc, is_zip, records


def load(
    path_or_found: Found | str | os.PathLike[str],
    map_location: Any = None,
    weights_only: bool = True,
    verify: bool = True,
    storage_options: dict[str, Any] | None = None,
    threads: int = _read.READ_THREADS,
    piece_bytes: int = _read.PIECE_BYTES,
    mmap: bool | None = None,
    **torch_load_kwargs: Any,
) -> Any:
    """What ``torch.load(path, map_location=..., weights_only=...)`` returns, read in parallel and,
    with ``verify=True``, with every CRC checked.

    ``path_or_found``: a ``latest()`` result, a file path, or a URL (``storage_options`` go to
    fsspec). ``map_location``: as for ``torch.load``; a CUDA device copies each storage through
    pinned host memory. ``weights_only``: as for ``torch.load`` (default True). ``threads`` and
    ``piece_bytes``: parallel readers and their read size. ``mmap``: ``True`` maps the file as
    ``torch.load(mmap=True)`` does (not for a URL); default reads each storage into memory of its
    own. A file that is not a zip is handed to ``torch.load`` as is. Other keyword arguments go to
    ``torch.load``.

    Raises:
        VerificationError: a CRC mismatch or a malformed file.
        ValueError: ``mmap=True`` with a URL."""
    found = path_or_found if isinstance(path_or_found, Found) else None
    path = path_or_found.path if isinstance(path_or_found, Found) else os.fspath(path_or_found)
    location, finish = _device_mapper(map_location)
    threads = max(1, threads)
    if _remote.is_url(path):  # the object into one host buffer, then unpickled from there
        if mmap:
            raise ValueError(f"lazyckpt.load(mmap=True): {path} is read into memory, it cannot be mapped")
        with _UrlSource(path, storage_options) as source:
            view = memoryview(bytearray(source.size))
            zip_records = records(source, path) if is_zip(source) else None
            _read_checked(source, zip_records if verify else None, path, threads, piece_bytes, into=view)
        buffer: Any = _BufferFile(view)  # a seekable binary file (typeshed's IO[bytes] is wider)
        result = torch.load(buffer, map_location=location, weights_only=weights_only, **torch_load_kwargs)
    else:
        threads = _read.readers(path, threads)
        with FileSource(path) as source:
            zipped = is_zip(source)
            identity = source.identity()
            verified = found is not None and found.verified is not None and found.verified == identity
            check = verify and not verified
            # storages latest() read while checking this very file (taken once)
            ahead = found.preread if found is not None else Preread.registered(path)
            preread = ahead.take(identity) if ahead is not None else None
            if zipped and not mmap:  # each storage read into memory of its own: what torch.load gives
                result = _load_private(
                    source, path, check, threads, piece_bytes, location, weights_only, torch_load_kwargs, preread
                )
            else:
                if check:
                    _read_checked(source, records(source, path) if zipped else None, path, threads, piece_bytes)
                elif not verified and not _fs.is_memory_filesystem(os.path.dirname(os.path.abspath(path))):
                    _read_checked(source, None, path, threads, piece_bytes)  # into the page cache, in parallel
                # The very file checked above (its descriptor), whatever has been renamed onto its name since.
                result = torch.load(
                    _read.fd_path(source.fd, path), map_location=location, weights_only=weights_only,
                    mmap=bool(mmap and zipped), **torch_load_kwargs,
                )  # fmt: skip
                if mmap and zipped:  # its tensors are pages of the file: keep it share-locked while mapped
                    _spare.hold_while_mapped(source.fd, path)
    finish()
    return result


# -- sources ----------------------------------------------------------------------------------------


class _UrlSource(FileSource):
    def __init__(self, url: str, storage_options: dict[str, Any] | None) -> None:
        self.fs, self.rpath = _remote.filesystem(url, storage_options)
        self.size = int(self.fs.size(self.rpath))

    def read_into(self, view: memoryview, offset: int) -> None:
        data = self.fs.cat_file(self.rpath, start=offset, end=offset + len(view))
        if len(data) != len(view):
            raise VerificationError(f"short ranged read at {offset}: {len(data)} of {len(view)} bytes")
        view[:] = data

    def close(self) -> None:
        pass


def _open(path: str, storage_options: dict[str, Any] | None) -> FileSource:
    return _UrlSource(path, storage_options) if _remote.is_url(path) else FileSource(path)


# -- records ----------------------------------------------------------------------------------------


def _read_checked(
    source: FileSource,
    checked_records: list[ZipEntry] | None,
    path: str,
    threads: int,
    piece: int,
    into: memoryview | None = None,
) -> None:
    """Read the whole file in parallel (into ``into``, else the page cache); check ``checked_records``."""
    checked = [r for r in checked_records or [] if r.stored and r.stop > r.start]
    crcs = _read.read_with_crcs(
        source.read_into, source.size, [(r.start, r.stop) for r in checked], threads=threads, piece=piece,
        chunk=piece if into is not None else _read.CHUNK_BYTES,  # a URL: a piece per request
        into=into,
    )  # fmt: skip
    for record, value in zip(checked, crcs, strict=True):
        check_crc(path, record, value)
    if checked_records is not None and len(checked) < len([r for r in checked_records if r.stop > r.start]):
        check_compressed(source, path)


class _BufferFile(Seekable):
    """The file's bytes in memory as a seekable file for ``torch.load``."""

    def __init__(self, view: memoryview) -> None:
        self.view, self.pos = view, 0

    @property
    def size(self) -> int:
        return len(self.view)

    def readinto(self, b: Any) -> int:
        chunk = self.view[self.pos : self.pos + len(b)]
        memoryview(b).cast("B")[: len(chunk)] = chunk
        self.pos += len(chunk)
        return len(chunk)


# -- storages into memory of their own ----------------------------------------------------------------


def _load_private(
    source: FileSource, path: str, check: bool, threads: int, piece: int, location: Any,
    weights_only: bool, kwargs: dict[str, Any], preread: dict[int, torch.UntypedStorage] | None = None,
) -> Any:  # fmt: skip
    """``torch.load`` of a local zip, its storages read here (or ``preread``) via ``overall_storage``."""
    unpickle = _private_unpickler(weights_only, kwargs)
    if unpickle is None:  # a torch without the hook, or options it cannot take: CRCs here, torch.load reads
        if check:
            _read_checked(source, records(source, path), path, threads, piece)
        return torch.load(_read.fd_path(source.fd, path), map_location=location, weights_only=weights_only, **kwargs)
    storages = preread
    if storages is None:
        all_records = records(source, path)
        data = _preread.data_records(all_records)
        storages, crcs = _preread.read_storages(source, data, threads, piece, crc=check)
        if check:
            for record, value in zip(data, crcs or [], strict=True):
                check_crc(path, record, value)
            rest = [r for r in all_records if r not in data]
            if rest:  # data.pkl, versions, byteorder: small
                _preread.check_small(source, rest, path)
    return unpickle(_read.fd_path(source.fd, path), location, _Storages(storages, path))


def _private_unpickler(weights_only: bool, kwargs: dict[str, Any]) -> Any:
    """An unpickler over ``torch.serialization._load``, or None where ``torch.load`` must do it."""
    import inspect
    import pickle

    ser = torch.serialization
    load = getattr(ser, "_load", None)
    opener = getattr(ser, "_open_zipfile_reader", None)
    if load is None or opener is None or "overall_storage" not in inspect.signature(load).parameters:
        return None
    args = dict(kwargs)
    module = args.pop("pickle_module", None)
    if weights_only and module is not None:
        return None  # torch.load refuses that pair: let it say so
    module = ser._weights_only_unpickler if weights_only else (module or pickle)
    if set(args) - {"encoding", "errors", "fix_imports"}:
        return None
    args.setdefault("encoding", "utf-8")

    def unpickle(name: str, map_location: Any, storages: _Storages) -> Any:
        with opener(name) as zip_file:
            try:
                return load(zip_file, map_location, module, overall_storage=storages, **args)
            except pickle.UnpicklingError as exc:
                if not weights_only:
                    raise
                raise pickle.UnpicklingError(
                    f"Weights only load failed (lazyckpt.load follows torch.load's weights_only=True default; "
                    f"pass weights_only=False only for a file you trust): {exc}"
                ) from None

    return unpickle


class _Storages:
    """``overall[offset:offset + n]`` for ``torch.serialization._load``: the storage read at ``offset``."""

    def __init__(self, by_offset: dict[int, torch.UntypedStorage], path: str) -> None:
        self.by_offset, self.path = by_offset, path

    def __getitem__(self, key: slice) -> torch.UntypedStorage:
        storage = self.by_offset.get(key.start)
        if storage is None or storage.nbytes() != key.stop - key.start:
            raise VerificationError(f"{self.path}: no storage record of {key.stop - key.start} bytes at {key.start}")
        return storage


# -- devices ----------------------------------------------------------------------------------------


def _device_mapper(map_location: Any) -> tuple[Any, Any]:
    """(map_location for torch.load, what to run after it); CUDA goes through pinned host buffers."""
    target = map_location
    if isinstance(target, str) and target.startswith("cuda"):
        target = torch.device(target)
    if not isinstance(target, torch.device) or target.type != "cuda":
        return map_location, lambda: None
    device = target if target.index is not None else torch.device("cuda", torch.cuda.current_device())
    staged: list[torch.UntypedStorage] = []  # pinned buffers in flight: kept alive until the sync

    def to_device(storage: torch.UntypedStorage, location: str) -> torch.UntypedStorage:
        nbytes = storage.nbytes()
        pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).untyped_storage()
        pinned.copy_(storage)
        out = torch.empty(nbytes, dtype=torch.uint8, device=device).untyped_storage()
        out.copy_(pinned, non_blocking=True)
        staged.append(pinned)
        return out

    def finish() -> None:
        torch.cuda.current_stream(device).synchronize()
        staged.clear()

    return to_device, finish
