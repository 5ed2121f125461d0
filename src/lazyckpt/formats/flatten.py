"""Flatten: what every format shares to turn the object passed to ``save()`` into bytes to write
now and sources (tensor bytes) to copy later: ``Source``, the checks that refuse tensors lazyckpt
cannot stage, and torch.save's pickler (``flatten_torch``, used by the torch format and by any
format made of torch.save items). Each format's own validation and layout live in its module.

Runs on the caller's thread inside ``save()``. Pickling here is what snapshots every non-tensor
value (optimizer ``param_groups``, per-parameter state dicts, loop counters): the pickle bytes are
immutable, whatever the caller changes afterwards. Tensor bytes are not pickled; each storage is
recorded with every tensor that refers to it and that tensor's ``_version`` at this moment, so a
later in-place change can be detected.
"""

from __future__ import annotations

import io
import pickle
from typing import Any

import torch
from torch.serialization import location_tag, normalize_storage_type

from lazyckpt.errors import SaveRefusedError

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
