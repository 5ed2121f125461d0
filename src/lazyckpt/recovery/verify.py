"""verify(): is this checkpoint file (or URL object) intact? Never runs code from the file.

torch.save files: every CRC32, and every metadata byte compared with the layout ``formats/torch_zip.py``
rebuilds; the pickle walked with stubs to check its storages exist. safetensors: header, offsets,
sizes, and lazyckpt's CRC when present. URLs are read by ranged reads, never downloaded.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from lazyckpt.core import remote as _remote
from lazyckpt.errors import VerificationError
from lazyckpt.formats import safetensors_file as _safetensorsfmt
from lazyckpt.formats.crc import crc32
from lazyckpt.formats.torch_zip import Record, central_directory, padded_local_header, record_at, zip64_extra
from lazyckpt.storage import spare as _spare

from ._read import READ_THREADS, FileIdentity, read_with_crcs, readers

__all__ = ["VerifyReport", "verify"]


@dataclass
class VerifyReport:
    """Outcome of ``verify(path)``.

    ``format`` is ``"torch"``, ``"safetensors"``, ``"unknown"`` (or ``"dcp"`` from
    ``verify_checkpoint``); ``problems`` lists what is wrong, empty when ``ok``; ``records`` counts
    zip records or tensors; ``raise_if_failed()`` raises ``VerificationError`` when not ``ok``.
    """

    path: str
    format: str
    size: int
    problems: list[str] = field(default_factory=list)
    records: int = 0
    # set when a local file passed and did not change while read (lets load() skip a second check)
    identity: FileIdentity | None = field(default=None, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_if_failed(self) -> None:
        if self.problems:
            raise VerificationError(f"{self.path}: " + "; ".join(self.problems))


def verify(
    path: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *, threads: int = READ_THREADS
) -> VerifyReport:
    """Check a torch.save or safetensors file written by lazyckpt or by the stock tools.

    ``path``: a local file or an fsspec URL (``s3://...``), read by ranged reads, never downloaded.
    ``storage_options``: passed to fsspec for a URL. ``threads``: readers of a local file.
    Returns a ``VerifyReport``; raises ``OSError`` when the file cannot be opened."""
    path = os.fspath(path)
    if _remote.is_url(path):
        return _verify_url(path, storage_options)
    with open(path, "rb") as fh:
        _spare.share_lock(fh.fileno(), path)  # a memory level's pages stay ours meanwhile
        fd = fh.fileno()
        return verify_fd(fd, path, lambda mm: _parallel_crcs(fd, mm, readers(path, threads)))


KnownCrcs = Callable[[mmap.mmap], dict[tuple[int, int], int]]  # a torch zip's map -> {(start, stop): CRC32}


def verify_fd(fd: int, path: str, known_crcs: KnownCrcs) -> VerifyReport:
    """``verify`` of the local file open as ``fd`` (share-locked by the caller for a memory level's
    file). ``known_crcs`` supplies record CRCs for a torch zip; ranges it omits are computed here."""
    before = FileIdentity.of(fd)
    report = VerifyReport(path, "unknown", before.size)
    if before.size == 0:
        report.problems.append("empty file")
        return report
    with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mm:
        known = known_crcs(mm) if mm[:4] == b"PK\x03\x04" else {}
        _verify_bytes(mm, mm, report, lambda a, b: known[(a, b)] if (a, b) in known else _crc(mm, a, b))
    if report.ok and FileIdentity.of(fd) == before:
        report.identity = before
    return report


def _parallel_crcs(fd: int, mm: mmap.mmap, threads: int) -> dict[tuple[int, int], int]:
    """{(data start, data stop): CRC32} of the records the zip headers point at, from one parallel
    read; damaged headers give unused ranges (the structure check computes its own)."""
    try:
        with zipfile.ZipFile(mm) as zf:  # type: ignore[call-overload]  # an mmap is a readable, seekable file
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError):
        return {}
    size, ranges = len(mm), []
    for info in infos:
        at = info.header_offset
        if at < 0 or at + 30 > size:
            continue
        name_len, extra_len = struct.unpack_from("<HH", mm, at + 26)
        start = at + 30 + name_len + extra_len
        if start + info.compress_size <= size:
            ranges.append((start, start + info.compress_size))

    def read_into(view: memoryview, offset: int) -> None:
        while view:
            n = os.preadv(fd, [view], offset)
            if n <= 0:
                raise OSError(5, f"file ended at byte {offset} while reading it")
            view, offset = view[n:], offset + n

    try:
        return dict(zip(ranges, read_with_crcs(read_into, size, ranges, threads=threads), strict=True))
    except OSError:  # e.g. shrunk meanwhile: the structure check finds it
        return {}


CrcOf = Callable[[int, int], int]  # CRC32 of the bytes [start, stop)


def _verify_bytes(source: Any, mm: Bytes, report: VerifyReport, crc_of: CrcOf) -> None:
    if mm[:4] == b"PK\x03\x04":
        report.format = "torch"
        _verify_torch(source, mm, report, crc_of)
    else:
        report.format = "safetensors"
        _verify_safetensors(mm, report)


def _verify_url(url: str, storage_options: dict[str, Any] | None) -> VerifyReport:
    fs, rpath = _remote.filesystem(url, storage_options)
    fs.invalidate_cache(rpath)  # a cached listing may predate the object
    size = int(fs.size(rpath))
    report = VerifyReport(url, "unknown", size)
    if size == 0:
        report.problems.append("empty object")
        return report
    with fs.open(rpath, "rb", block_size=_BLOCK) as fh:
        reader = _RangeReader(fh, size)
        _verify_bytes(fh, reader, report, lambda a, b: _crc(reader, a, b))
    return report


_BLOCK = 8 << 20


class _RangeReader:
    """The slicing that verify does on an mmap, as ranged reads of an fsspec file."""

    def __init__(self, fh: Any, size: int) -> None:
        self.fh, self.size = fh, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, key: slice) -> bytes:
        start, stop, _ = key.indices(self.size)
        if stop <= start:
            return b""
        self.fh.seek(start)
        return bytes(self.fh.read(stop - start))


Bytes = mmap.mmap | _RangeReader


def _crc(mm: Bytes, start: int, stop: int, value: int = 0) -> int:
    """CRC32 of ``mm[start:stop]``: in place for an mmap, in blocks for ranged reads."""
    if isinstance(mm, mmap.mmap):
        return crc32(memoryview(mm)[start:stop], value)
    for at in range(start, stop, _BLOCK):
        value = crc32(mm[at : min(stop, at + _BLOCK)], value)
    return value


# torch.save -------------------------------------------------------------------------------------


def _verify_torch(source: Any, mm: Bytes, report: VerifyReport, crc_of: CrcOf) -> None:
    try:
        with zipfile.ZipFile(source) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        report.problems.append(f"not a readable zip (truncated or corrupt end records): {exc}")
        return
    report.records = len(infos)
    alignment = _alignment(mm, infos)
    minimal = any(info.filename.endswith("/.format_version") for info in infos)
    records: list[Record] = []
    cursor = 0
    for info in infos:
        problem = _check_record(mm, info, cursor, alignment, records, crc_of, minimal)
        if problem:
            report.problems.append(problem)
            return
        cursor = records[-1].end
    expected = central_directory(records, cursor)
    if mm[cursor:] != expected:
        at = cursor + next((i for i, (a, b) in enumerate(zip(mm[cursor:], expected, strict=False)) if a != b), 0)
        report.problems.append(f"central directory or end records differ from the torch.save layout near byte {at}")
        return
    _check_pickle(mm, records, report)


def _alignment(mm: Bytes, infos: list[zipfile.ZipInfo]) -> int:
    for info in infos:
        if info.filename.endswith("/.storage_alignment") and info.file_size < 16:
            start = info.header_offset + 30 + len(info.orig_filename.encode())
            extra = int.from_bytes(mm[info.header_offset + 28 : info.header_offset + 30], "little")
            try:
                return int(mm[start + extra : start + extra + info.file_size])
            except ValueError:
                return 64
    return 64


def _check_record(
    mm: Bytes,
    info: zipfile.ZipInfo,
    cursor: int,
    alignment: int,
    records: list[Record],
    crc_of: CrcOf,
    minimal: bool = False,
) -> str | None:
    name = info.orig_filename.encode()
    size = info.file_size
    if info.header_offset != cursor:
        return f"{info.filename}: record at byte {info.header_offset}, expected {cursor}"
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != size:
        return f"{info.filename}: compressed or inconsistent sizes"
    # Padding is one ``FB`` extra field (lazyckpt's zero-copy layout may pad beyond the alignment);
    # a file with ``.format_version`` must have torch.save's minimal padding (torch computes offsets).
    extra_len = int.from_bytes(mm[cursor + 28 : cursor + 30], "little")
    z64 = len(zip64_extra(size, cursor))
    pad = extra_len - z64 - 4
    if pad < 0:
        return f"{info.filename}: local header corrupt (extra field of {extra_len} bytes)"
    least = (-(cursor + 30 + len(name) + z64 + 4)) % alignment
    if minimal and pad != least:
        return (
            f"{info.filename}: {pad} bytes of header padding where torch.save puts {least}, in a file whose "
            ".format_version lets torch compute offsets from the minimal layout (calculate_storage_offsets)"
        )
    rec = record_at(name, size, cursor, pad)
    header, data_offset = rec.local_header, rec.data_offset
    if data_offset % alignment:
        return f"{info.filename}: data at byte {data_offset}, not a multiple of the storage alignment {alignment}"
    # a local zip64 field stating the real compressed size instead of 0 is also intact
    legacy = padded_local_header(name, size, cursor, pad, compressed=size)[0]
    if mm[cursor : cursor + len(header)] not in (header, legacy):
        return f"{info.filename}: local header corrupt (bytes {cursor}-{cursor + len(header)})"
    if data_offset + size > len(mm):
        return f"{info.filename}: data runs past the end of the file (truncated)"
    crc = crc_of(data_offset, data_offset + size) if size else 0
    if crc != info.CRC:
        return f"{info.filename}: CRC32 mismatch (stored {info.CRC:08x}, data {crc:08x})"
    rec = replace(rec, crc=crc)
    desc = rec.descriptor()
    if mm[data_offset + size : data_offset + size + len(desc)] != desc:
        return f"{info.filename}: data descriptor corrupt"
    records.append(rec)
    return None


class _Stub:
    """Stands in for every object in the pickle: nothing from the file is ever imported or run."""

    name = "?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        pass

    def __setitem__(self, key: Any, value: Any) -> None:
        pass

    def append(self, value: Any) -> None:
        pass

    def extend(self, values: Any) -> None:
        pass


class _StubUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes) -> None:
        import io

        super().__init__(io.BytesIO(data))
        self.storages: list[tuple[str, str, int]] = []  # (key, storage type name, numel)

    def find_class(self, module: str, name: str) -> Any:
        return type(name, (_Stub,), {"name": name})

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage":
            self.storages.append((str(pid[2]), getattr(pid[1], "name", "?"), int(pid[4])))
        return _Stub()


def _element_size(storage_type: str) -> int:
    import warnings

    import torch

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TypedStorage classes are deprecated, still what torch.save names
            return int(getattr(torch, storage_type).dtype.itemsize)
    except Exception:
        return 1


def _check_pickle(mm: Bytes, records: list[Record], report: VerifyReport) -> None:
    by_name = {r.name.decode().split("/", 1)[-1]: r for r in records}
    pkl = by_name.get("data.pkl")
    if pkl is None:
        report.problems.append("no data.pkl record: not a torch.save file")
        return
    unpickler = _StubUnpickler(mm[pkl.data_offset : pkl.data_offset + pkl.size])
    try:
        unpickler.load()
    except Exception as exc:
        report.problems.append(f"data.pkl does not unpickle: {exc}")
        return
    for key, storage_type, numel in unpickler.storages:
        rec = by_name.get(f"data/{key}")
        if rec is None:
            report.problems.append(f"storage {key} referenced by the pickle is missing")
        elif rec.size < numel * _element_size(storage_type):
            report.problems.append(f"storage {key} holds {rec.size} bytes, needs {numel} x {storage_type}")


# safetensors ------------------------------------------------------------------------------------

_ST_SIZES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "C64": 8, "U64": 8, "U32": 4, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1,
}  # fmt: skip


def _verify_safetensors(mm: Bytes, report: VerifyReport) -> None:
    size = len(mm)
    if size < 8:
        report.problems.append("too short for a safetensors header")
        return
    n = int.from_bytes(mm[:8], "little")
    if n > size - 8 or n > 100 << 20:
        report.format = "unknown"
        report.problems.append("neither a torch.save zip nor a safetensors file (bad header length)")
        return
    try:
        header = json.loads(mm[8 : 8 + n])
    except ValueError as exc:
        report.problems.append(f"safetensors header is not JSON: {exc}")
        return
    if not isinstance(header, dict):
        report.problems.append("safetensors header is not a JSON object")
        return
    header.pop("__metadata__", None)
    spans = []
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            numel = 1
            for d in entry["shape"]:
                numel *= int(d)
            want = numel * _ST_SIZES[entry["dtype"]]
        except (KeyError, TypeError, ValueError):
            report.problems.append(f"{name}: malformed header entry")
            return
        if end - begin != want:
            report.problems.append(f"{name}: {end - begin} bytes for shape {entry['shape']} {entry['dtype']}")
        spans.append((begin, end))
    spans.sort()
    cursor = 0
    for begin, end in spans:
        if begin != cursor:
            report.problems.append(f"gap or overlap in tensor data at byte {8 + n + cursor}")
            return
        cursor = end
    report.records = len(spans)
    if 8 + n + cursor != size:
        report.problems.append(f"file is {size} bytes, header describes {8 + n + cursor} (truncated or padded)")
        return
    _check_safetensors_crc(mm, report)


def _check_safetensors_crc(mm: Bytes, report: VerifyReport) -> None:
    prefix, at = _safetensorsfmt.PREFIX, _safetensorsfmt.CRC_AT
    damaged = sum(a != b for a, b in zip(mm[8:at], prefix, strict=True))
    if damaged == 0:
        stored = mm[at : at + 8].decode("ascii", "replace")
        crc = _crc(mm, 0, at)
        crc = crc32(b"00000000", crc)
        crc = _crc(mm, at + 8, len(mm), crc)
        if f"{crc:08x}" != stored:
            report.problems.append(f"CRC32 mismatch (stored {stored}, file {crc:08x})")
    elif damaged <= 2:  # one or two flipped bytes inside lazyckpt's integrity field itself
        report.problems.append("lazyckpt integrity field in the header is damaged")
