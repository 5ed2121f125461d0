"""The safetensors format: a flat dict of tensors laid out as ``safetensors.torch.save`` does.

With CRCs on, the header's first ``__metadata__`` entry ``lazyckpt_crc32`` holds the CRC32 of the
whole file with those 8 hex digits read as ``00000000``: written as a placeholder, patched once the
data is in (no offset moves). ``verify`` checks it; readers ignore it; user metadata may not use it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from lazyckpt.errors import SaveRefusedError
from lazyckpt.formats.capture import Source, refuse_unsupported
from lazyckpt.formats.crc import crc32, crc32_combine
from lazyckpt.storage.fs import PAGE

CRC_KEY = "lazyckpt_crc32"
PREFIX = b'{"__metadata__":{"' + CRC_KEY.encode() + b'":"'  # right after the 8-byte length
CRC_AT = 8 + len(PREFIX)  # offset of the 8 hex digits

# safetensors' data order (by dtype, then name): element sizes never grow, so each tensor is aligned
_TORCH_NAMES = {
    "U64": "uint64", "I64": "int64", "F64": "float64", "C64": "complex64", "F32": "float32", "U32": "uint32",
    "I32": "int32", "BF16": "bfloat16", "F16": "float16", "U16": "uint16", "I16": "int16", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
DTYPES: dict[torch.dtype, str] = {getattr(torch, t): code for code, t in _TORCH_NAMES.items() if hasattr(torch, t)}
_RANK = {code: i for i, code in enumerate(_TORCH_NAMES)}


class SafetensorsFormat:
    """``format="safetensors"`` (a ``base.Format``): what ``safetensors.torch.save_file`` writes,
    plus ``lazyckpt_crc32`` when CRCs are on."""

    name = "safetensors"

    def flatten(self, obj: Any, metadata: dict[str, str] | None) -> SafetensorsPlanner:
        """Validate a flat ``dict[str, Tensor]`` and string metadata; one source per tensor."""
        _check_metadata(metadata)
        if not isinstance(obj, dict):
            raise SaveRefusedError(f"format='safetensors' takes a flat dict[str, Tensor], got {type(obj).__name__}")
        for name, t in obj.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise SaveRefusedError(
                    f"format='safetensors' takes a flat dict[str, Tensor]; key {name!r} holds {type(t).__name__}. "
                    "Use format='torch' for nested objects."
                )
            refuse_unsupported(t, name)
            if t.dtype not in DTYPES:
                raise SaveRefusedError(f"{name}: dtype {t.dtype} has no safetensors equivalent")
            if not t.is_contiguous():
                raise SaveRefusedError(f"{name}: safetensors needs contiguous tensors; call .contiguous() first")
        _refuse_shared(obj)
        order = sorted(obj, key=lambda n: (_RANK[DTYPES[obj[n].dtype]], n))
        sources = [Source.of_tensor(name, name, obj[name]) for name in order]
        return SafetensorsPlanner(metadata, sources, {name: TensorInfo.of(obj[name]) for name in order})


@dataclass(frozen=True)
class TensorInfo:
    """What the header says of a tensor, besides its offsets."""

    dtype: str  # safetensors' name, e.g. "BF16"
    shape: list[int]
    element_size: int

    @staticmethod
    def of(t: torch.Tensor) -> TensorInfo:
        return TensorInfo(DTYPES[t.dtype], list(t.shape), t.element_size())


@dataclass
class SafetensorsPlanner:
    """The validated tensors of one save, to be laid out (a ``base.Planner``)."""

    metadata: dict[str, str] | None
    sources: list[Source]  # one per tensor (key: its name); after plan(), in file order
    tensors: dict[str, TensorInfo]

    def plan(self, path: str, phases: Mapping[str, int], crc: bool) -> SafetensorsLayout:
        """Order the tensors, build the header, set each ``Source.file_offset``. With ``phases``,
        tensors of one element size are reordered and the header padded so that as many as
        possible sit at their phase (for O_DIRECT writes from their memory)."""
        by_name = {s.key: s for s in self.sources}
        order, shift = [s.key for s in self.sources], None
        if phases:
            sizes = {name: info.element_size for name, info in self.tensors.items()}
            order, shift = _phase_order(order, sizes, {k: s.nbytes for k, s in by_name.items()}, phases)
        entries: dict[str, Any] = {}
        offset = 0
        for name in order:
            src = by_name[name]
            info = self.tensors[name]
            entries[name] = {"dtype": info.dtype, "shape": info.shape, "data_offsets": [offset, offset + src.nbytes]}
            src.file_offset = offset
            offset += src.nbytes
        head = header(entries, self.metadata, crc, data_start_phase=shift)
        self.sources = [by_name[name] for name in order]
        for src in self.sources:
            src.file_offset += len(head)
        return SafetensorsLayout(head, crc, [(s.key, s.nbytes) for s in self.sources], len(head) + offset)


@dataclass
class SafetensorsLayout:
    """A safetensors file's ``base.Layout``: the header at 0, then the tensors end to end. With
    ``with_crc`` the header waits for the data's CRCs."""

    head: bytes
    with_crc: bool
    regions: list[tuple[str, int]]  # (tensor name, nbytes) in file order, right after the header
    file_bytes: int

    def fixed_writes(self) -> list[tuple[int, bytes]]:
        return [] if self.with_crc else [(0, self.head)]

    def crc_writes(self, crcs: Mapping[str, int] | None) -> list[tuple[int, bytes]]:
        """The header with the whole file's CRC (combined from each tensor's), when CRCs are on."""
        if not self.with_crc:
            return []
        crc = crc32(self.head)
        for key, nbytes in self.regions:
            crc = crc32_combine(crc, (crcs or {}).get(key, 0), nbytes)
        return [(0, with_crc(self.head, crc))]


FORMAT = SafetensorsFormat()


def header(
    entries: dict[str, Any], metadata: dict[str, str] | None, with_crc: bool, data_start_phase: int | None = None
) -> bytes:
    """The 8-byte length + JSON header, space-padded to a multiple of 8; with ``data_start_phase``
    (a multiple of 8), padded further so the data starts that many bytes past a page boundary."""
    meta = {CRC_KEY: "00000000"} if with_crc else {}
    meta.update(metadata or {})
    blob = json.dumps(
        {"__metadata__": meta, **entries} if meta else entries, separators=(",", ":"), ensure_ascii=False
    ).encode()
    blob += b" " * ((-len(blob)) % 8)
    if data_start_phase is not None:
        blob += b" " * ((data_start_phase - 8 - len(blob)) % PAGE)
    return len(blob).to_bytes(8, "little") + blob


def with_crc(head: bytes, crc: int) -> bytes:
    """Fill the CRC placeholder in a header made by ``header(..., with_crc=True)``."""
    if head[8:CRC_AT] != PREFIX:  # only a bug here could get this far: never patch a user's bytes
        raise ValueError("safetensors header does not start with lazyckpt's CRC placeholder")
    return head[:CRC_AT] + f"{crc:08x}".encode() + head[CRC_AT + 8 :]


def _check_metadata(metadata: Any) -> None:
    if metadata is None:
        return
    if not isinstance(metadata, dict):
        raise SaveRefusedError("metadata must be a dict[str, str]")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SaveRefusedError("safetensors metadata must be a dict[str, str]")
    if CRC_KEY in metadata:
        # its value is patched at a fixed offset: a user value would break the header or the CRC
        raise SaveRefusedError(
            f"safetensors metadata key {CRC_KEY!r} is reserved for lazyckpt's integrity field; "
            "drop it from metadata (lazyckpt writes a fresh one when crc=True)"
        )


def _phase_order(
    order: list[str], element_sizes: dict[str, int], sizes: dict[str, int], phases: Mapping[str, int]
) -> tuple[list[str], int | None]:
    """Reorder within each element size so that the tensors ``phases`` names sit at their phase
    (mod PAGE); return the order and the data start's phase (None: no tensor qualifies). Greedy:
    the largest wanted tensor fixes the data start."""
    wanted = {n: phases[n] for n in order if n in phases}
    if not wanted:
        return order, None
    out: list[str] = []
    start: int | None = None  # phase of the data start within a page
    cursor = 0
    groups: dict[int, list[str]] = {}
    for n in order:
        groups.setdefault(element_sizes[n], []).append(n)
    for _, names in sorted(groups.items(), reverse=True):
        by_phase: dict[int, list[str]] = {}
        for n in sorted((n for n in names if n in wanted), key=lambda n: -sizes[n]):
            by_phase.setdefault(wanted[n], []).append(n)
        if start is None and by_phase:
            first = max((n for n in names if n in wanted), key=lambda n: sizes[n])
            start = (wanted[first] - cursor) % PAGE
            if start % 8:  # the header is padded in whole 8-byte units
                return order, None
        rest = [n for n in names if n not in wanted]
        while by_phase or rest:
            need = (start + cursor) % PAGE if start is not None else None
            if need is not None and by_phase.get(need):
                n = by_phase[need].pop(0)
                if not by_phase[need]:
                    del by_phase[need]
            elif rest:
                n = rest.pop(0)
            else:  # no wanted tensor fits here: place the largest; it will be copied first
                phase = max(by_phase, key=lambda p: sizes[by_phase[p][0]])
                n = by_phase[phase].pop(0)
                if not by_phase[phase]:
                    del by_phase[phase]
            out.append(n)
            cursor += sizes[n]
    return out, start


def _refuse_shared(tensors: dict[str, torch.Tensor]) -> None:
    spans: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
    for name, t in tensors.items():
        if t.numel() == 0:
            continue
        start = t.data_ptr()
        key = (str(t.device), t.untyped_storage().data_ptr())
        spans.setdefault(key, []).append((start, start + t.numel() * t.element_size(), name))
    for group in spans.values():
        group.sort()
        for (_, end, a), (start, _, b) in zip(group, group[1:], strict=False):
            if start < end:
                raise SaveRefusedError(
                    f"tensors {a!r} and {b!r} share memory; safetensors cannot store shared tensors. "
                    "Save one of them, or clone() the other (safetensors.torch.save_model drops tied duplicates)."
                )
