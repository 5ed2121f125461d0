"""The torch format: ``torch.save``'s stored zip, byte for byte as miniz writes it, laid out by offset.

Every size is known up front, so every offset is: storage data is written in parallel in place, and
only the data descriptors and central directory (which carry CRCs) wait for the data. ``verify``
rebuilds files with ``Record``, ``record_at`` and ``central_directory``.
"""

from __future__ import annotations

import os
import struct
import sys
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from lazyckpt.errors import SaveRefusedError
from lazyckpt.formats.capture import Source, flatten_torch
from lazyckpt.formats.crc import crc32
from lazyckpt.storage.fs import PAGE

_U32 = 0xFFFFFFFF  # the "see zip64 extra" marker
_ZIP64_LIMIT = _U32  # sizes/offsets from here on need zip64 fields (tests lower it)
_LOCAL_SIG = 0x04034B50
_CENTRAL_SIG = 0x02014B50
_DESC_SIG = 0x08074B50
_FLAGS = 0x0808  # bit 3: sizes in data descriptor; bit 11: UTF-8 names
_FLAGS_EMPTY = 0x0800  # miniz writes empty records without a data descriptor
LOCAL_COMPRESSED = 0  # the compressed size in a local header's zip64 field (see zip64_extra)


class TorchFormat:
    """``format="torch"``: what ``torch.save(obj, path)`` writes (a ``base.Format``)."""

    name = "torch"

    def flatten(self, obj: Any, metadata: dict[str, str] | None) -> TorchPlanner:
        if metadata is not None:
            raise SaveRefusedError("metadata is only stored by format='safetensors'")
        pickle_bytes, sources = flatten_torch(obj)
        return TorchPlanner(pickle_bytes, sources)


@dataclass
class TorchPlanner:
    """The pickle and the storages of one object, to be laid out (a ``base.Planner``)."""

    pickle_bytes: bytes
    sources: list[Source]  # one per storage, in record order

    def plan(self, path: str, phases: Mapping[str, int], crc: bool) -> TorchLayout:
        """Lay out the file and set each ``Source.file_offset``. Phases that are not a multiple of
        the storage alignment are dropped; ``crc`` changes nothing here."""
        alignment = storage_alignment()
        usable = {key: phase for key, phase in phases.items() if phase % alignment == 0}
        layout = plan(path, self.pickle_bytes, [(s.key, s.nbytes) for s in self.sources], alignment, usable)
        for src in self.sources:
            src.file_offset = layout.data_offset(src.key)
        return layout


FORMAT = TorchFormat()


def storage_alignment() -> int:
    """The alignment torch.save uses for record data (64 unless configured otherwise)."""
    try:
        from torch.utils.serialization import config

        return int(config.save.storage_alignment)
    except Exception:  # older torch
        return 64


def archive_name(path: str) -> str:
    """The record prefix torch.save derives from ``path``: the basename without its extension, or
    ``archive`` when the path is not ASCII."""
    if not path.isascii():
        return "archive"
    base = os.path.basename(path)
    stem = base.rsplit(".", 1)[0] if "." in base else base
    return stem or "archive"


@dataclass(frozen=True)
class Record:
    """One zip record of a torch.save file: where its local header and data sit, and their bytes.
    ``crc`` is known up front for small records (``data``); a storage's comes with its data."""

    name: bytes
    size: int
    header_offset: int
    data_offset: int
    zip64: bool
    local_header: bytes
    data: bytes | None = None  # small records, known up front
    crc: int = 0

    @property
    def end(self) -> int:
        """Offset right after the record, data descriptor included."""
        return self.data_offset + self.size + len(self.descriptor())

    def descriptor(self) -> bytes:
        """The data descriptor miniz writes after the data (none for an empty record)."""
        if self.size == 0:
            return b""
        if self.zip64:
            return struct.pack("<IIQQ", _DESC_SIG, self.crc, self.size, self.size)
        return struct.pack("<IIII", _DESC_SIG, self.crc, self.size, self.size)

    def central_entry(self) -> bytes:
        size32 = _U32 if self.size >= _ZIP64_LIMIT else self.size
        off32 = _U32 if self.header_offset >= _ZIP64_LIMIT else self.header_offset
        extra = zip64_extra(self.size, self.header_offset)
        head = struct.pack(
            "<IHHHHHHIIIHHHHHII",
            _CENTRAL_SIG, 0, 0, _flags(self.size), 0, 0, 0, self.crc, size32, size32,
            len(self.name), len(extra), 0, 0, 0, 0, off32,
        )  # fmt: skip
        return head + self.name + extra


def record_at(name: bytes, size: int, offset: int, pad: int, data: bytes | None = None, crc: int = 0) -> Record:
    """The record named ``name`` of ``size`` bytes whose local header starts at ``offset`` and whose
    ``FB`` extra field holds ``pad`` bytes of padding."""
    header, data_offset = padded_local_header(name, size, offset, pad)
    return Record(name, size, offset, data_offset, needs_zip64(size, offset), header, data, crc)


@dataclass
class TorchLayout:
    """A torch.save file's ``base.Layout``: data regions at ``data_offset(key)``; fixed: local
    headers and small records; given the CRCs: data descriptors, central directory, end records."""

    records: list[Record]
    storage_index: dict[str, int]  # storage key -> index in records
    central_offset: int
    total_size: int

    @property
    def file_bytes(self) -> int:
        return self.total_size

    def data_offset(self, key: str) -> int:
        return self.records[self.storage_index[key]].data_offset

    def fixed_writes(self) -> list[tuple[int, bytes]]:
        writes = [(rec.header_offset, rec.local_header) for rec in self.records]
        return writes + [(rec.data_offset, rec.data) for rec in self.records if rec.data]

    def crc_writes(self, crcs: Mapping[str, int] | None) -> list[tuple[int, bytes]]:
        """Descriptors, central directory and end records, given each storage's CRC (None: CRCs off,
        zeros as with ``skip_data``; small records always carry theirs)."""
        records = list(self.records)
        for key, idx in self.storage_index.items():
            records[idx] = replace(records[idx], crc=(crcs or {}).get(key, 0))
        writes = [(rec.data_offset + rec.size, rec.descriptor()) for rec in records if rec.size]
        return [*writes, (self.central_offset, central_directory(records, self.central_offset))]


def zip64_extra(size: int, offset: int, compressed: int | None = None) -> bytes:
    """The zip64 extra field of a record of ``size`` bytes at ``offset`` (may be empty), stating
    ``compressed`` as compressed size (default ``size``; local headers state 0)."""
    fields = b""
    if size >= _ZIP64_LIMIT:
        fields += struct.pack("<QQ", size, size if compressed is None else compressed)
    if offset >= _ZIP64_LIMIT:
        fields += struct.pack("<Q", offset)
    return struct.pack("<HH", 1, len(fields)) + fields if fields else b""


def needs_zip64(size: int, offset: int) -> bool:
    """Whether the record's data descriptor takes zip64 sizes (miniz: size or offset past 4 GiB)."""
    return size >= _ZIP64_LIMIT or offset >= _ZIP64_LIMIT


def _flags(size: int) -> int:
    return _FLAGS if size else _FLAGS_EMPTY


def _local_header(name: bytes, size: int, offset: int, alignment: int, phase: int | None = None) -> tuple[bytes, int]:
    """The local header of a record at ``offset`` and its data start: the next multiple of
    ``alignment``, or given ``phase``, the next offset ``phase`` bytes past a page boundary."""
    return padded_local_header(name, size, offset, _padding(name, size, offset, alignment, phase))


def _padding(name: bytes, size: int, offset: int, alignment: int, phase: int | None) -> int:
    z64 = len(zip64_extra(size, offset))
    start = offset + 30 + len(name) + z64 + 4
    pad = (-start) % alignment if phase is None else (phase - start) % PAGE
    if z64 + 4 + pad > 0xFFFF:  # the extra field's length is 16 bits (64 KiB pages): not this one
        pad = (-start) % alignment
    return pad


def padded_local_header(
    name: bytes, size: int, offset: int, pad: int, compressed: int = LOCAL_COMPRESSED
) -> tuple[bytes, int]:
    """The local header of a record at ``offset`` whose ``FB`` extra field holds ``pad`` bytes, and
    its data start."""
    z64 = zip64_extra(size, offset, compressed)
    start = offset + 30 + len(name) + len(z64) + 4
    extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    head = struct.pack("<IHHHHHIIIHH", _LOCAL_SIG, 0, _flags(size), 0, 0, 0, 0, 0, 0, len(name), len(extra))
    return head + name + extra, start + pad


def central_directory(records: list[Record], central_offset: int) -> bytes:
    """The central directory of ``records`` at ``central_offset`` and the end records after it."""
    central = b"".join(rec.central_entry() for rec in records)
    n, cd_size = len(records), len(central)
    z64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, cd_size, central_offset)
    locator = struct.pack("<IIQI", 0x07064B50, 0, central_offset + cd_size, 1)
    eocd = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
        cd_size if cd_size < _ZIP64_LIMIT else _U32,
        central_offset if central_offset < _ZIP64_LIMIT else _U32, 0,
    )  # fmt: skip
    return central + z64 + locator + eocd


def central_directory_size(records: list[Record]) -> int:
    """``len(central_directory(records, ...))`` without building it."""
    return sum(46 + len(rec.name) + len(zip64_extra(rec.size, rec.header_offset)) for rec in records) + 98


def plan(
    path: str,
    pickle_bytes: bytes,
    storage_sizes: list[tuple[str, int]],
    alignment: int | None = None,
    phases: dict[str, int] | None = None,
) -> TorchLayout:
    """Lay out a torch.save file for ``pickle_bytes`` and storages of the given sizes.

    ``alignment`` defaults to torch.save's. ``phases`` (storage key -> a multiple of ``alignment``
    below ``PAGE``) places those storages at that position within a page (for O_DIRECT writes from
    their memory), padding in torch.save's ``FB`` field; such a file omits ``.format_version``,
    which would let torch >= 2.5 compute offsets assuming minimal padding. ``ValueError`` on bad phases.
    """
    alignment = alignment or storage_alignment()
    phases = phases or {}
    if any(p % alignment or not 0 <= p < PAGE for p in phases.values()):
        raise ValueError(f"phases must be multiples of the storage alignment {alignment} below {PAGE}")
    prefix = archive_name(path)
    serialization_id = _serialization_id()
    small_head = [("data.pkl", pickle_bytes)]
    if not phases:
        small_head.append((".format_version", b"1"))
    small_head += [(".storage_alignment", str(alignment).encode()), ("byteorder", sys.byteorder.encode())]
    small_tail = [("version", b"3\n"), (".data/serialization_id", serialization_id.encode())]
    entries: list[tuple[str, int, bytes | None]] = [(n, len(d), d) for n, d in small_head]
    entries += [(f"data/{key}", size, None) for key, size in storage_sizes]
    entries += [(n, len(d), d) for n, d in small_tail]

    records: list[Record] = []
    storage_index: dict[str, int] = {}
    cursor = 0
    for rel, size, data in entries:
        name = f"{prefix}/{rel}".encode()
        phase = phases.get(rel[len("data/") :]) if data is None else None
        pad = _padding(name, size, cursor, alignment, phase)
        rec = record_at(name, size, cursor, pad, data, crc32(data) if data is not None else 0)
        if data is None:
            storage_index[rel[len("data/") :]] = len(records)
        records.append(rec)
        cursor = rec.end
    total = cursor + central_directory_size(records)  # its size does not depend on the CRCs
    return TorchLayout(records, storage_index, central_offset=cursor, total_size=total)


def _serialization_id() -> str:
    # Never the global `random`: a save must not advance the user's RNG (torch.save doesn't).
    return str(int.from_bytes(os.urandom(17), "little")).zfill(40)[:40]
