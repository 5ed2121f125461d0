"""Flatten: turn the object passed to ``save()`` into bytes to write now and storages to copy later.

Runs on the caller's thread inside ``save()``. Pickling here is what snapshots every non-tensor
value (optimizer ``param_groups``, per-parameter state dicts, loop counters): the pickle bytes are
immutable, whatever the caller changes afterwards. Tensor bytes are not pickled; each storage is
recorded with every tensor that refers to it and that tensor's ``_version`` at this moment, so a
later in-place change can be detected.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from typing import Any

import torch
from torch.serialization import location_tag, normalize_storage_type

from . import _safetensorsfmt
from .errors import SaveRefusedError

_PICKLE_PROTOCOL = 2  # torch.serialization.DEFAULT_PROTOCOL
_PLAIN_TENSOR_TYPES: tuple[type, ...] = (torch.Tensor, torch.nn.Parameter)
if hasattr(torch.nn.parameter, "Buffer"):
    _PLAIN_TENSOR_TYPES += (torch.nn.parameter.Buffer,)  # type: ignore[attr-defined]


_NO_BYTES = torch.empty(0, dtype=torch.uint8)


class Source:
    """Bytes of one record to stage and write: a whole storage (torch) or one tensor (safetensors).

    Holds references to the caller's tensors only until staging is over (``release``), so a save
    never keeps device memory alive while it waits for storage.
    """

    def __init__(
        self,
        key: str,
        bytes_of: torch.UntypedStorage | torch.Tensor,  # a storage, or a 1-D uint8 tensor view
        nbytes: int,
        checks: list[tuple[str, torch.Tensor, int]] | None = None,  # (name, tensor, _version at save)
        file_offset: int = 0,
    ) -> None:
        self.key, self.nbytes, self.file_offset = key, nbytes, file_offset
        self.live = False  # written from its own memory (see Engine._queue_live)
        self.checks = checks if checks is not None else []
        self._bytes: torch.UntypedStorage | torch.Tensor | None = bytes_of
        self.device = bytes_of.device
        self.data_ptr = bytes_of.data_ptr()
        self.storage_ptr = (
            bytes_of.data_ptr()
            if isinstance(bytes_of, torch.UntypedStorage)
            else (bytes_of.untyped_storage().data_ptr())
        )

    @property
    def flat(self) -> torch.Tensor:
        """The bytes as a 1-D uint8 tensor (built on first use: cheap pointers are enough for CPU)."""
        if isinstance(self._bytes, torch.UntypedStorage):
            self._bytes = _flat_bytes(self._bytes)
        return self._bytes if self._bytes is not None else _NO_BYTES

    def release(self) -> None:
        self._bytes, self.checks = None, []

    def first_stale(self) -> str | None:
        """Name of a tensor changed in place since save(), or None."""
        for name, tensor, version in self.checks:
            if tensor._version != version:
                return name
        return None


def tensor_names(obj: Any, prefix: str = "", out: dict[int, str] | None = None, depth: int = 0) -> dict[int, str]:
    """Map id(tensor) -> a readable path like ``optimizer.state.3.exp_avg`` for error messages."""
    out = {} if out is None else out
    if depth > 64:
        return out
    if isinstance(obj, torch.Tensor):
        out.setdefault(id(obj), prefix or "<root>")
    elif isinstance(obj, dict):
        for k, v in obj.items():
            tensor_names(v, f"{prefix}.{k}" if prefix else str(k), out, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            tensor_names(v, f"{prefix}.{i}" if prefix else str(i), out, depth + 1)
    return out


def refuse_unsupported(t: torch.Tensor, name: str) -> None:
    """Raise SaveRefusedError for tensors whose bytes lazyckpt cannot stage faithfully."""
    if type(t) not in _PLAIN_TENSOR_TYPES:
        raise SaveRefusedError(
            f"{name}: tensor subclass {type(t).__module__}.{type(t).__qualname__} is not supported; "
            "convert it to a plain tensor first (e.g. DTensor.full_tensor()), or use torch.save for this object"
        )
    if t.layout != torch.strided or t.is_nested:
        raise SaveRefusedError(f"{name}: {t.layout} tensors are not supported; call .to_dense() before saving")
    if t.is_meta:
        raise SaveRefusedError(f"{name}: meta tensors have no data to save; materialize it (e.g. .to_empty()) first")
    if t.is_quantized:
        raise SaveRefusedError(f"{name}: quantized tensors are not supported; dequantize() or use torch.save")
    if t.device.type not in ("cpu", "cuda") and not torch._C._has_storage(t):
        raise SaveRefusedError(f"{name}: tensors on {t.device.type} have no storage to stage; move them to CPU first")


def _flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


_IS_STORAGE: dict[type, bool] = {}


class _Pickler(pickle.Pickler):
    """torch.save's pickler: identical persistent ids, plus bookkeeping of tensors per storage."""

    def __init__(self, buf: io.BytesIO, names: dict[int, str]) -> None:
        super().__init__(buf, protocol=_PICKLE_PROTOCOL)
        self.names = names
        self.sources: dict[str, Source] = {}
        self._keys: dict[int, str] = {}
        self._dtypes: dict[int, torch.dtype] = {}
        self._tensors_by_storage: dict[int, list[tuple[str, torch.Tensor, int]]] = {}

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            name = self.names.get(id(obj), f"<tensor inside an object, shape {tuple(obj.shape)}>")
            refuse_unsupported(obj, name)
            cdata = obj.untyped_storage()._cdata
            self._tensors_by_storage.setdefault(cdata, []).append((name, obj, obj._version))
        return NotImplemented

    def persistent_id(self, obj: Any) -> Any:
        # Called for every object pickled: answer "not a storage" from a per-type cache.
        cls = type(obj)
        is_storage = _IS_STORAGE.get(cls)
        if is_storage is None:
            is_storage = _IS_STORAGE[cls] = isinstance(obj, torch.storage.TypedStorage) or torch.is_storage(obj)
        if not is_storage:
            return None
        if isinstance(obj, torch.storage.TypedStorage):
            storage = obj._untyped_storage
            dtype = obj.dtype
            storage_type = getattr(torch, obj._pickle_storage_type())
            numel = obj._size()
        else:
            storage, dtype = obj, torch.uint8
            storage_type = normalize_storage_type(type(obj))
            numel = storage.nbytes()
        if storage.device.type == "meta":
            raise SaveRefusedError("meta storages have no data to save; materialize them first")
        ptr = storage.data_ptr()
        if ptr != 0 and self._dtypes.setdefault(ptr, dtype) != dtype:
            raise SaveRefusedError(
                "Cannot save multiple tensors or storages that view the same data as different types "
                "(torch.save refuses this too)"
            )
        key = self._keys.setdefault(storage._cdata, str(len(self._keys)))
        if key not in self.sources:
            checks = self._tensors_by_storage.get(storage._cdata, [])
            self.sources[key] = Source(key, storage, storage.nbytes(), checks)
        return ("storage", storage_type, key, location_tag(storage), numel)


def flatten_torch(obj: Any) -> tuple[bytes, list[Source]]:
    """Pickle ``obj`` as torch.save would; return the pickle and the storages in record order."""
    buf = io.BytesIO()
    pickler = _Pickler(buf, tensor_names(obj))
    try:
        pickler.dump(obj)
    except SaveRefusedError:
        raise
    except Exception as exc:
        raise SaveRefusedError(
            f"cannot pickle the object passed to save(): {exc}. Everything except tensors must be picklable "
            "(as for torch.save); convert or drop the offending value."
        ) from exc
    return buf.getvalue(), list(pickler.sources.values())


# safetensors ------------------------------------------------------------------------------------

_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL", torch.complex64: "C64",
}  # fmt: skip
for _name, _code in [
    ("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2"), ("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64"),
]:  # fmt: skip
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


def flatten_safetensors(
    tensors: Any,
    metadata: dict[str, str] | None,
    with_crc: bool = True,
    page_phase: Callable[[torch.Tensor], int | None] | None = None,
) -> tuple[bytes, list[Source]]:
    """Validate a flat dict of tensors; return the safetensors header and one source per tensor.

    Tensors are laid out as safetensors lays them out: by element size, largest first (so every
    tensor is aligned to its element size), then by name. With ``page_phase`` (tensor -> position
    within a page its file offset should have, or None), tensors of one element size are ordered so
    that as many of those bytes as possible get that position, and the header is padded (with the
    spaces safetensors pads it with) to match: those tensors can then be written with O_DIRECT
    straight from their memory. Readers look tensors up by the header's offsets; order is free.
    """
    if not isinstance(tensors, dict):
        raise SaveRefusedError(f"format='safetensors' takes a flat dict[str, Tensor], got {type(tensors).__name__}")
    if metadata is not None and not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise SaveRefusedError("safetensors metadata must be a dict[str, str]")
    if metadata is not None and _safetensorsfmt.CRC_KEY in metadata:
        # The key's value is patched at a fixed offset once the data's CRC is known: a user value
        # there would break the header's JSON or the CRC. Copied from an earlier file, it is stale anyway.
        raise SaveRefusedError(
            f"safetensors metadata key {_safetensorsfmt.CRC_KEY!r} is reserved for lazyckpt's integrity field; "
            "drop it from metadata (lazyckpt writes a fresh one when crc=True)"
        )
    for name, t in tensors.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise SaveRefusedError(
                f"format='safetensors' takes a flat dict[str, Tensor]; key {name!r} holds {type(t).__name__}. "
                "Use format='torch' for nested objects."
            )
        refuse_unsupported(t, name)
        if t.dtype not in _ST_DTYPES:
            raise SaveRefusedError(f"{name}: dtype {t.dtype} has no safetensors equivalent")
        if not t.is_contiguous():
            raise SaveRefusedError(f"{name}: safetensors needs contiguous tensors; call .contiguous() first")
    _refuse_shared(tensors)
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    shift = None
    if page_phase is not None:
        order, shift = _phase_order(tensors, order, page_phase)
    entries: dict[str, Any] = {}
    sources: list[Source] = []
    offset = 0
    for name in order:
        t = tensors[name]
        nbytes = t.numel() * t.element_size()
        entries[name] = {
            "dtype": _ST_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        flat = t.detach().reshape(-1).view(torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        sources.append(Source(name, flat, nbytes, [(name, t, t._version)], file_offset=offset))
        offset += nbytes
    head = _safetensorsfmt.header(entries, metadata, with_crc, data_start_phase=shift)
    for src in sources:
        src.file_offset += len(head)
    return head, sources


def _phase_order(
    tensors: dict[str, torch.Tensor], order: list[str], page_phase: Callable[[torch.Tensor], int | None]
) -> tuple[list[str], int | None]:
    """Reorder within each element size so that the tensors ``page_phase`` names sit at (data start
    + offset) = their phase (mod PAGE) for one data start; return the order and that data start's phase
    (None: no tensor qualifies). Greedy: the largest wanted tensor fixes the data start; then, at each
    point, a wanted tensor whose phase matches the running offset goes next if there is one."""
    from ._pool import PAGE

    wanted = {n: p for n in order if (p := page_phase(tensors[n])) is not None}
    if not wanted:
        return order, None
    sizes = {n: tensors[n].numel() * tensors[n].element_size() for n in order}
    out: list[str] = []
    start: int | None = None  # phase of the data start within a page
    cursor = 0
    groups: dict[int, list[str]] = {}
    for n in order:
        groups.setdefault(tensors[n].element_size(), []).append(n)
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
