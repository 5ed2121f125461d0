"""``load()``: read a torch.save zip file (lazyckpt's or torch's) with parallel reads, check every
record's CRC32 while reading, return what ``torch.load`` returns.

Data flow: the zip's central directory and local headers are read first (``zipfile``, a few small
reads); then the whole file is read by ``threads`` threads (``recovery/_read.py``: pieces of
``piece_bytes``, read in cache-sized chunks, each chunk folded into the CRC32 of the records it
holds; ISA-L when installed; the reads and the CRC release the GIL), and a mismatch raises
``VerificationError`` naming the record before anything is unpickled. A local file is read into
memory of its own per storage, as ``torch.load`` allocates them (``_load_private``: the threads read
each storage's record straight into its allocation, CRC as the bytes land), and torch's unpickler
then takes those storages as they are (no second copy). Nothing is left to copy later: the
optimizer's first step after a resume writes memory the process owns (with the file mapped instead,
``mmap=True``, that step copied every page it wrote, copy-on-write: measured 1.5-2 s for a 1.17 GB
GPT + AdamW on this VM, which made a resume from memory only ~2x torch.load from disk when counted
to the end of that step). A ``Found`` from ``latest()`` whose file was verified there
(``Found.verified``) is not checked again when the file opened here has the same identity (device,
inode, size, mtime, ctime): one CRC pass per resume; any other file, or a changed one, is checked
here. That pass was also the read (``latest(preload=True)``, the default: ``_preread.preread``
read the storages into memory of their own while checking them, and the ``Found`` holds them):
``load(found)`` takes them (``Preread.take``, once, for that same identity) and only unpickles,
so a resume reads the file once (measured on this VM, GPT + AdamW, 1.17 GB from the memory level,
to the end of the first step: 4.5x torch.load from disk, was 2.7x with a check pass and a read);
``load(found.path)`` finds them too while that ``Found`` lives (``Preread.registered``). A URL is
read by ranged reads into ONE host buffer, which ``torch.load`` unpickles (one memory copy per
storage). ``weights_only`` (default True, as torch's) and ``map_location`` are passed
through. The buffers, the threads and the file descriptor belong to the call. A checkpoint file is
never changed after its commit (lazyckpt and torch.save rename complete files into place), so the
bytes checked are the bytes read or mapped. On a memory filesystem the descriptor is share-locked
(``storage/spare.py``): a memory level never reuses the pages of a file being read here, nor of one
whose tensors a ``load(mmap=True)`` in this or another process still maps.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from lazyckpt.recovery import reads as _read
from lazyckpt.storage import fs as _fs
from lazyckpt.storage import remote as _remote
from lazyckpt.storage import spare as _spare

from ..errors import VerificationError
from . import _preread
from ._found import Found, Preread
from ._preread import FileSource, Record, Seekable, check_compressed, check_crc, is_zip, records


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
    with ``verify=True``, with every CRC checked (``VerificationError`` on a mismatch).

    ``path_or_found``: a ``latest()`` result, a file path, or a URL (``storage_options`` go to
    fsspec). ``map_location="cuda"`` (or a CUDA device) copies each storage through pinned host
    memory to the device as ``torch.load`` hands it over (non-blocking copies; one synchronize at
    the end). A file that is not a zip (torch's legacy format) is handed to ``torch.load`` as is.

    ``mmap``: ``None`` or ``False`` (default) reads each storage into memory of its own, as
    ``torch.load`` does by default (in parallel, straight into the storage's allocation): the first
    optimizer step after the resume pays nothing more; ``True`` maps the file as
    ``torch.load(mmap=True)`` (no copy while loading, but a step that writes the tensors copies
    their pages then; the file stays share-locked while they are mapped, so a memory level does
    not reuse its pages; a URL's object is read into memory first, so it cannot be mapped).
    Other keyword arguments go to ``torch.load``."""
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
            # what latest() read into memory while checking this very file (once: then it is the caller's)
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
    checked_records: list[Record] | None,
    path: str,
    threads: int,
    piece: int,
    into: memoryview | None = None,
) -> None:
    """Read the whole file in parallel (into ``into``, or through scratch buffers for the page
    cache's sake) and check the CRCs of ``records`` (None: read only)."""
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
    """The file's bytes in memory as a seekable file for ``torch.load`` (``readinto`` copies each
    record straight into its storage)."""

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
    """``torch.load`` of a local zip whose storages are read here, in parallel, each into an allocation
    of its own (or were, by ``latest()``: ``preread``), and handed to torch's unpickler as they are
    (``overall_storage``, the hook that ``torch.load(mmap=True)`` fills with the mapped file: here a
    lookup of the storages by offset)."""
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
    """``(name, map_location, storages) -> object`` through ``torch.serialization._load`` as
    ``torch.load`` calls it, or None where this torch's ``_load`` lacks ``overall_storage`` or the
    caller passed ``torch.load`` options beyond ``pickle_module`` and the unpickler's own."""
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
    """What ``torch.serialization._load`` slices for each storage (``overall[offset:offset + n]``):
    here the storage read for the record whose data starts at ``offset``."""

    def __init__(self, by_offset: dict[int, torch.UntypedStorage], path: str) -> None:
        self.by_offset, self.path = by_offset, path

    def __getitem__(self, key: slice) -> torch.UntypedStorage:
        storage = self.by_offset.get(key.start)
        if storage is None or storage.nbytes() != key.stop - key.start:
            raise VerificationError(f"{self.path}: no storage record of {key.stop - key.start} bytes at {key.start}")
        return storage


# -- devices ----------------------------------------------------------------------------------------


def _device_mapper(map_location: Any) -> tuple[Any, Any]:
    """(map_location for torch.load, what to run after it). CUDA: through pinned host buffers."""
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
