"""The format contract: how ``save()`` turns an object into a file layout.

1. ``Format.flatten(obj, metadata) -> Planner``, on the caller's thread inside ``save()``: refuse
   what the format cannot store (``SaveRefusedError``, nothing written), snapshot non-tensor
   values, list the ``Source``s (tensor bytes) to write.
2. ``Planner.plan(path, phases, crc) -> Layout``: set each source's ``file_offset`` (honouring
   ``phases``, source key -> position within a page, where it can), ``sources`` in file order.

A ``Layout`` is three disjoint kinds of bytes: data regions (each source at its ``file_offset``),
``fixed_writes()`` (known up front) and ``crc_writes(crcs)`` (depend on the data's CRCs).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from lazyckpt.errors import SaveRefusedError
from lazyckpt.formats import safetensors_file as _safetensorsfmt
from lazyckpt.formats import torch_zip as _torchfmt
from lazyckpt.formats.capture import Source

Write = tuple[int, bytes]  # (file offset, bytes)


class Layout(Protocol):
    """Where every byte of one file goes."""

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
