"""CRC32 as the zip format wants it: ISA-L when installed (releases the GIL), else zlib; and
``crc32_combine`` to join per-piece CRCs in file order without rereading the data."""

from __future__ import annotations

import zlib
from collections.abc import Callable

try:
    from isal import isal_zlib as _isal

    crc32: Callable[..., int] = _isal.crc32
    CRC_IMPL = "isal"
except Exception:  # pragma: no cover - depends on the environment
    crc32 = zlib.crc32
    CRC_IMPL = "zlib"

_POLY = 0xEDB88320


def _multmodp(a: int, b: int) -> int:
    """Multiply a and b modulo the CRC polynomial (bit-reflected), as zlib does."""
    m = 1 << 31
    p = 0
    while True:
        if a & m:
            p ^= b
            if (a & (m - 1)) == 0:
                return p
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


def _x2n_table() -> list[int]:
    table = [1 << 30]  # x^1
    for _ in range(31):
        table.append(_multmodp(table[-1], table[-1]))
    return table


_X2N = _x2n_table()


def _x2nmodp(n: int, k: int) -> int:
    p = 1 << 31  # x^0
    while n:
        if n & 1:
            p = _multmodp(_X2N[k & 31], p)
        n >>= 1
        k += 1
    return p


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """CRC32 of A+B given crc32(A), crc32(B) and len(B)."""
    if len2 <= 0:
        return crc1
    if crc1 == 0:  # the first piece of a record (crc32 of b"" is 0): nothing to shift
        return crc2
    return _multmodp(_x2nmodp(len2, 3), crc1) ^ crc2
