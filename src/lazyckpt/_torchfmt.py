"""The torch.save file layout: a stored (uncompressed) zip, written by offset.

Mirrors what ``torch.save`` (PyTorchStreamWriter, miniz) writes: record names ``<archive>/...``,
local headers with zero CRC/sizes and bit 3 set, an ``FB`` extra field padding each record's data
to the storage alignment, a data descriptor after each record, a central directory and the zip64
end records. Because every size is known before a byte is written, every offset is known too:
storage data can be written in parallel at its final place, and only the data descriptors and the
central directory (which carry CRCs) wait for the data.
"""

from __future__ import annotations

import os
import struct
import sys
from dataclasses import dataclass

from ._crc import crc32
from ._pool import PAGE

_U32 = 0xFFFFFFFF  # the "see zip64 extra" marker
_ZIP64_LIMIT = _U32  # sizes/offsets from here on need zip64 fields (tests lower it)
_LOCAL_SIG = 0x04034B50
_CENTRAL_SIG = 0x02014B50
_DESC_SIG = 0x08074B50
_FLAGS = 0x0808  # bit 3: sizes in data descriptor; bit 11: UTF-8 names
_FLAGS_EMPTY = 0x0800  # miniz writes empty records without a data descriptor


def storage_alignment() -> int:
    """The alignment torch.save uses for record data (64 unless configured otherwise)."""
    try:
        from torch.utils.serialization import config

        return int(config.save.storage_alignment)
    except Exception:  # older torch
        return 64


def archive_name(path: str) -> str:
    """The record prefix torch.save derives from the file name: basename without extension."""
    base = os.path.basename(path)
    stem = base.rsplit(".", 1)[0] if "." in base else base
    return stem or "archive"


@dataclass
class _Record:
    name: bytes
    size: int
    header_offset: int
    data_offset: int
    zip64: bool
    local_header: bytes
    data: bytes | None = None  # small records, known up front
    crc: int | None = None


@dataclass
class TorchLayout:
    """Where every byte of one torch.save file goes."""

    records: list[_Record]
    storage_index: dict[str, int]  # storage key -> index in records
    central_offset: int
    total_size: int

    def data_offset(self, key: str) -> int:
        return self.records[self.storage_index[key]].data_offset

    def metadata_writes(self, storage_crcs: dict[str, int]) -> list[tuple[int, bytes]]:
        """Every non-storage byte of the file, as (offset, bytes), given the storage CRCs."""
        writes: list[tuple[int, bytes]] = []
        central = bytearray()
        for key, idx in self.storage_index.items():
            self.records[idx].crc = storage_crcs.get(key, 0)
        for rec in self.records:
            writes.append((rec.header_offset, rec.local_header))
            if rec.data is not None and rec.data:
                writes.append((rec.data_offset, rec.data))
            assert rec.crc is not None
            if rec.size:
                writes.append((rec.data_offset + rec.size, _descriptor(rec)))
            central += _central_entry(rec)
        writes.append((self.central_offset, bytes(central) + _end_records(self)))
        return writes


def _zip64_extra(size: int, offset: int) -> bytes:
    fields = b""
    if size >= _ZIP64_LIMIT:
        fields += struct.pack("<QQ", size, size)
    if offset >= _ZIP64_LIMIT:
        fields += struct.pack("<Q", offset)
    return struct.pack("<HH", 1, len(fields)) + fields if fields else b""


def _flags(size: int) -> int:
    return _FLAGS if size else _FLAGS_EMPTY


def _descriptor_size(size: int, zip64: bool) -> int:
    return 0 if size == 0 else 24 if zip64 else 16


def _local_header(name: bytes, size: int, offset: int, alignment: int, phase: int | None = None) -> tuple[bytes, int]:
    """The local header of a record starting at ``offset`` and where its data starts: at the next
    multiple of ``alignment`` (torch.save), or, given ``phase``, at the next offset that is ``phase``
    bytes past a page boundary (lazyckpt's zero-copy layout: see ``plan``)."""
    z64 = len(_zip64_extra(size, offset))
    start = offset + 30 + len(name) + z64 + 4
    pad = (-start) % alignment if phase is None else (phase - start) % PAGE
    if z64 + 4 + pad > 0xFFFF:  # the extra field's length is 16 bits (64 KiB pages): not this one
        pad = (-start) % alignment
    return padded_local_header(name, size, offset, pad)


def padded_local_header(name: bytes, size: int, offset: int, pad: int) -> tuple[bytes, int]:
    """The local header of a record at ``offset`` whose ``FB`` extra field holds ``pad`` bytes."""
    z64 = _zip64_extra(size, offset)
    start = offset + 30 + len(name) + len(z64) + 4
    extra = z64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
    head = struct.pack("<IHHHHHIIIHH", _LOCAL_SIG, 0, _flags(size), 0, 0, 0, 0, 0, 0, len(name), len(extra))
    return head + name + extra, start + pad


def _descriptor(rec: _Record) -> bytes:
    if rec.size == 0:
        return b""
    if rec.zip64:
        return struct.pack("<IIQQ", _DESC_SIG, rec.crc, rec.size, rec.size)
    return struct.pack("<IIII", _DESC_SIG, rec.crc, rec.size, rec.size)


def _central_entry(rec: _Record) -> bytes:
    size32 = _U32 if rec.size >= _ZIP64_LIMIT else rec.size
    off32 = _U32 if rec.header_offset >= _ZIP64_LIMIT else rec.header_offset
    extra = _zip64_extra(rec.size, rec.header_offset)
    head = struct.pack(
        "<IHHHHHHIIIHHHHHII",
        _CENTRAL_SIG, 0, 0, _flags(rec.size), 0, 0, 0, rec.crc, size32, size32,
        len(rec.name), len(extra), 0, 0, 0, 0, off32,
    )  # fmt: skip
    return head + rec.name + extra


def _end_records(layout: TorchLayout) -> bytes:
    n = len(layout.records)
    cd_size = sum(_central_size(r) for r in layout.records)
    z64_offset = layout.central_offset + cd_size
    z64 = struct.pack("<IQHHIIQQQQ", 0x06064B50, 44, 0x031E, 0x2D, 0, 0, n, n, cd_size, layout.central_offset)
    locator = struct.pack("<IIQI", 0x07064B50, 0, z64_offset, 1)
    eocd = struct.pack(
        "<IHHHHIIH", 0x06054B50, 0, 0, min(n, 0xFFFF), min(n, 0xFFFF),
        cd_size if cd_size < _ZIP64_LIMIT else _U32,
        layout.central_offset if layout.central_offset < _ZIP64_LIMIT else _U32, 0,
    )  # fmt: skip
    return z64 + locator + eocd


def plan(
    path: str,
    pickle_bytes: bytes,
    storage_sizes: list[tuple[str, int]],
    alignment: int | None = None,
    phases: dict[str, int] | None = None,
) -> TorchLayout:
    """Lay out a torch.save file for ``pickle_bytes`` and storages of the given sizes.

    ``alignment`` defaults to torch.save's (64). ``phases`` (storage key -> a multiple of
    ``alignment`` below ``PAGE``) places those storages' data at that position within a page, the
    position their memory has, so that their whole pages can be written with O_DIRECT straight from
    the tensors. The padding goes in the same ``FB`` extra field torch.save pads with, so every
    reader that follows the local headers (``torch.load``, ``mmap=True``, ``zipfile``) reads the
    file unchanged. Such a file carries no ``.format_version`` record, as files from torch < 2.5 do:
    that record tells torch >= 2.5 it may *compute* offsets assuming minimal padding
    (``config.load.calculate_storage_offsets``), which would be wrong here.
    """
    alignment = alignment or storage_alignment()
    phases = phases or {}
    if any(p % alignment or not 0 <= p < PAGE for p in phases.values()):
        raise ValueError(f"phases must be multiples of the storage alignment {alignment} below {PAGE}")
    prefix = archive_name(path)
    # Never the global `random`: a save must not advance the user's RNG (torch.save doesn't).
    serialization_id = str(int.from_bytes(os.urandom(17), "little")).zfill(40)[:40]
    small_head = [("data.pkl", pickle_bytes)]
    if not phases:
        small_head.append((".format_version", b"1"))
    small_head += [(".storage_alignment", str(alignment).encode()), ("byteorder", sys.byteorder.encode())]
    small_tail = [("version", b"3\n"), (".data/serialization_id", serialization_id.encode())]
    entries: list[tuple[str, int, bytes | None]] = [(n, len(d), d) for n, d in small_head]
    entries += [(f"data/{key}", size, None) for key, size in storage_sizes]
    entries += [(n, len(d), d) for n, d in small_tail]

    records: list[_Record] = []
    storage_index: dict[str, int] = {}
    cursor = 0
    for rel, size, data in entries:
        name = f"{prefix}/{rel}".encode()
        phase = phases.get(rel[len("data/") :]) if data is None else None
        header, data_offset = _local_header(name, size, cursor, alignment, phase)
        zip64 = size >= _ZIP64_LIMIT or cursor >= _ZIP64_LIMIT
        rec = _Record(name, size, cursor, data_offset, zip64, header, data, crc32(data) if data is not None else None)
        if data is None:
            storage_index[rel[len("data/") :]] = len(records)
        records.append(rec)
        cursor = data_offset + size + _descriptor_size(size, zip64)
    cd_size = sum(_central_size(r) for r in records)
    return TorchLayout(records, storage_index, central_offset=cursor, total_size=cursor + cd_size + _END_SIZE)


_END_SIZE = 56 + 20 + 22  # zip64 end record + zip64 locator + end record


def _central_size(rec: _Record) -> int:
    return 46 + len(rec.name) + len(_zip64_extra(rec.size, rec.header_offset))
