"""The format contract: how ``save()`` turns an object into a file layout, whatever the format.

Two steps, each a call on an interface (as DCP's ``SavePlanner`` -> ``StorageWriter``):

1. ``Format.flatten(obj, metadata) -> Planner``, on the caller's thread inside ``save()``: refuse
   what the format cannot store (``SaveRefusedError``, nothing written), snapshot every value that
   is not tensor bytes, and list the ``Source``s (tensor bytes) to stage and write.
2. ``Planner.plan(path, phases, crc) -> Layout``: fix every byte's offset. ``phases`` (source key
   -> position within a page) asks for sources that will be written straight from their memory to
   sit at their address's position within a page; a format honours what it can. ``plan`` sets each
   source's ``file_offset`` and leaves ``Planner.sources`` in file order.

A ``Layout`` is the whole file as three kinds of bytes, none overlapping:

- data regions: each source's bytes at its ``file_offset``, written by the writers as they arrive;
- ``fixed_writes()``: bytes known up front (headers, small records);
- ``crc_writes(crcs)``: bytes that depend on the data's CRCs (``crcs``: source key -> CRC32 of its
  bytes, or None with CRCs off): zip data descriptors and central directory, safetensors'
  integrity field.

``Job.metadata_writes`` writes the last two once every data region is in. A format made of several
items concatenated in one file (DCP's ``.distcp``: torch.save zips of single tensors and raw byte
items, each at an offset) is a planner that lays out each item with the existing ones and shifts
their regions and writes by the item's offset.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from lazyckpt.core.capture import Source
from lazyckpt.errors import SaveRefusedError
from lazyckpt.formats import safetensors_file as _safetensorsfmt
from lazyckpt.formats import torch_zip as _torchfmt

Write = tuple[int, bytes]  # (file offset, bytes)


class Layout(Protocol):
    """Where every byte of one file goes (see the module docstring)."""

    @property
    def file_bytes(self) -> int: ...

    def fixed_writes(self) -> list[Write]:
        """Bytes known before any data: may be written at any time."""
        ...

    def crc_writes(self, crcs: Mapping[str, int] | None) -> list[Write]:
        """Bytes that depend on the data, given each source's CRC32 (None: CRCs off)."""
        ...


class Planner(Protocol):
    """One save's flattened object, ready to be laid out."""

    sources: list[Source]

    def plan(self, path: str, phases: Mapping[str, int], crc: bool) -> Layout: ...


class Format(Protocol):
    """A file format ``save(..., format=name)`` writes."""

    name: str

    def flatten(self, obj: Any, metadata: dict[str, str] | None) -> Planner: ...


FORMATS: dict[str, Format] = {f.name: f for f in (_torchfmt.FORMAT, _safetensorsfmt.FORMAT)}


def get(name: str) -> Format:
    """The format called ``name``; ``SaveRefusedError`` for any other name."""
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        choices = " or ".join(repr(n) for n in FORMATS)
        raise SaveRefusedError(f"unknown format {name!r}; use {choices}") from None
