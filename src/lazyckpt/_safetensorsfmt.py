"""The safetensors layout, plus an integrity field stock readers ignore.

safetensors has no checksum. When CRCs are on, lazyckpt stores, as the first entry of the header's
``__metadata__``, ``lazyckpt_crc32``: the CRC32 of the whole file with those 8 hex digits read as
``00000000``. ``verify`` checks it; every safetensors reader ignores it. The header is laid out
with the placeholder and patched once the data is written, so no offset moves.
"""

from __future__ import annotations

import json
from typing import Any

from ._pool import PAGE

CRC_KEY = "lazyckpt_crc32"
PREFIX = b'{"__metadata__":{"' + CRC_KEY.encode() + b'":"'  # right after the 8-byte length
CRC_AT = 8 + len(PREFIX)  # offset of the 8 hex digits


def header(
    entries: dict[str, Any], metadata: dict[str, str] | None, with_crc: bool, data_start_phase: int | None = None
) -> bytes:
    """The 8-byte length + JSON header, padded with spaces to a multiple of 8 as safetensors does;
    with ``data_start_phase`` (a multiple of 8), padded further (less than a page) so that the data
    starts that many bytes past a page boundary."""
    meta = {CRC_KEY: "00000000"} if with_crc else {}
    meta.update(metadata or {})
    blob = json.dumps({"__metadata__": meta, **entries} if meta else entries, separators=(",", ":")).encode()
    blob += b" " * ((-len(blob)) % 8)
    if data_start_phase is not None:
        blob += b" " * ((data_start_phase - 8 - len(blob)) % PAGE)
    return len(blob).to_bytes(8, "little") + blob


def with_crc(head: bytes, crc: int) -> bytes:
    """Fill the CRC placeholder in a header made by ``header(..., with_crc=True)``."""
    assert head[8:CRC_AT] == PREFIX
    return head[:CRC_AT] + f"{crc:08x}".encode() + head[CRC_AT + 8 :]
