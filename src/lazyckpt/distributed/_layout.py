"""The per-rank data file ``__<rank>_0.distcp``, laid out before a byte is written.

DCP's layout (each item's bytes or ``torch.save`` zip back to back), with every zip planned by
``formats/torch_zip.py`` so all offsets are known up front; items are packed with no gap, so the
segments' CRCs combine into one CRC of the whole file.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass

from lazyckpt.formats.crc import _multmodp, _x2nmodp, crc32
from lazyckpt.formats.torch_zip import TorchLayout, plan
from lazyckpt.storage.fs import PAGE


@dataclass
class _TensorItem:
    key: str  # the core Source key of this item's bytes
    base: int  # offset of the item's zip in the file
    zip: TorchLayout
    nbytes: int  # tensor bytes


@dataclass
class _BytesItem:
    base: int
    data: bytes


class RankFileLayout:
    """Where every byte of one rank's ``.distcp`` file goes (the core ``Job``'s ``layout``)."""

    def __init__(self, crc: bool) -> None:
        self.crc = crc
        self.total_size = 0
        self._tensors: dict[str, _TensorItem] = {}
        self._bytes: list[_BytesItem] = []
        self.file_crc: int | None = None  # set by crc_writes (None when CRCs are off)

    def add_bytes(self, data: bytes) -> tuple[int, int]:
        """Place a ``BYTE_IO`` item; return its (offset, length)."""
        item = _BytesItem(self.total_size, bytes(data))
        self._bytes.append(item)
        self.total_size += len(item.data)
        return item.base, len(item.data)

    def add_tensor(self, key: str, pickle_bytes: bytes, nbytes: int, phase: int | None = None) -> tuple[int, int]:
        """Place a tensor item whose torch.save pickle is ``pickle_bytes`` (one storage, key "0", of
        ``nbytes``); return the (offset, length) of its zip. With ``phase`` (a multiple of 64 below a
        page), its data lands that many bytes past a page boundary (the zip then starts 64-aligned)."""
        phases = None
        if phase is not None:
            pad = -self.total_size % 64
            if pad:
                self.add_bytes(bytes(pad))
            phases = (("0", (phase - self.total_size) % PAGE),)
        zip_layout = _item_zip(pickle_bytes, nbytes, phases)
        item = _TensorItem(key, self.total_size, zip_layout, nbytes)
        self._tensors[key] = item
        self.total_size += zip_layout.total_size
        return item.base, zip_layout.total_size

    def data_offset(self, key: str) -> int:
        item = self._tensors[key]
        return item.base + item.zip.data_offset("0")

    @property
    def file_bytes(self) -> int:
        return self.total_size

    def fixed_writes(self) -> list[tuple[int, bytes]]:
        """Bytes known up front: ``BYTE_IO`` items and every zip's headers and small records."""
        writes = [(b.base, b.data) for b in self._bytes]
        for item in self._tensors.values():
            writes += [(item.base + offset, data) for offset, data in item.zip.fixed_writes()]
        return writes

    def crc_writes(self, crcs: Mapping[str, int] | None) -> list[tuple[int, bytes]]:
        """Every zip's descriptors and central directory given each tensor's data CRC (None: CRCs
        off); computes ``file_crc``, the CRC of the whole file."""
        writes = []
        for item in self._tensors.values():
            part = None if crcs is None else {"0": crcs.get(item.key, 0)}
            writes += [(item.base + offset, data) for offset, data in item.zip.crc_writes(part)]
        if self.crc and crcs is not None:
            self.file_crc = self._file_crc([*self.fixed_writes(), *writes], crcs)
        return writes

    def _file_crc(self, writes: list[tuple[int, bytes]], crcs: Mapping[str, int]) -> int:
        """CRC32 of the whole file, in file order: fixed bytes continue the running CRC, each
        tensor's data CRC is appended with one combine."""
        segments: list[tuple[int, int, bytes | None, int]] = [(o, len(d), d, 0) for o, d in writes if d]
        segments += [(self.data_offset(i.key), i.nbytes, None, crcs.get(i.key, 0)) for i in self._tensors.values()]
        segments.sort(key=lambda seg: seg[0])
        crc, end = 0, 0
        for offset, n, data, part in segments:
            if n == 0:
                continue
            if offset != end:  # cannot happen for a packed layout; refuse rather than record a wrong CRC
                raise AssertionError(f"gap or overlap at offset {end} (next segment at {offset})")
            crc = crc32(data, crc) if data is not None else _multmodp(_shift(n), crc) ^ part
            end = offset + n
        if end != self.total_size:
            raise AssertionError(f"segments end at {end}, file is {self.total_size} bytes")
        return crc


@functools.lru_cache(maxsize=16384)
def _item_zip(pickle_bytes: bytes, nbytes: int, phases: tuple[tuple[str, int], ...] | None) -> TorchLayout:
    """One tensor item's zip, independent of its place in the file: cached (never mutated)."""
    return plan("archive", pickle_bytes, [("0", nbytes)], phases=dict(phases) if phases else None)


@functools.lru_cache(maxsize=4096)
def _shift(nbytes: int) -> int:
    """x^(8 * nbytes) modulo the CRC polynomial: appending nbytes to a CRC multiplies it by this."""
    return _x2nmodp(nbytes, 3)
