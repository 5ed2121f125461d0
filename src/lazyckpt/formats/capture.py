"""Capture, shared by every format, on the caller's thread inside ``save()``: the saved object as bytes to
write now and ``Source`` records (tensor bytes) to copy later.

Holds ``Source``, the checks that refuse tensors lazyckpt cannot stage, and torch.save's pickler
(``flatten_torch``). Pickling snapshots every non-tensor value; each storage is recorded with its tensors
and their ``_version`` at ``save()``, so a later in-place change is detected.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections import OrderedDict
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
    """Bytes of one record to stage and write: a whole storage (torch) or one tensor (safetensors). Holds
    the caller's tensors only until staging is over (``release``)."""

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

    @classmethod
    def of_tensor(cls, key: str, name: str, t: torch.Tensor) -> Source:
        """One tensor's bytes as a record (a safetensors entry, a DCP rank file's item), checked
        against in-place changes under ``name``."""
        nbytes = t.numel() * t.element_size()
        flat = t.detach().reshape(-1).view(torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        return cls(key, flat, nbytes, [(name, t, _version(t))])

    def first_stale(self) -> str | None:
        """Name of a tensor changed in place since save(), or None."""
        for name, tensor, version in self.checks:
            if _version(tensor) != version:
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
    if t.device.type not in ("cpu", "cuda") and not _has_storage(t):
        raise SaveRefusedError(f"{name}: tensors on {t.device.type} have no storage to stage; move them to CPU first")


def _version(t: torch.Tensor) -> int:
    return t._version


def _flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


_IS_STORAGE: dict[type, bool] = {}


class _Pickler(pickle.Pickler):
    """torch.save's pickler (same bytes, same persistent ids), recording the tensors of each storage.

    ``fast=False`` is torch.save's own path. ``fast=True`` writes the same bytes with fewer Python calls: a
    plain tensor is reduced here (its storage's id computed at once) and ``persistent_id`` is a C no-op
    except between such a reduction and its storage. Any other storage raises ``_NeedPlainPath``, and
    ``flatten_torch`` pickles again on the plain path.
    """

    def __init__(self, buf: io.BytesIO, names: dict[int, str], fast: bool = False) -> None:
        super().__init__(buf, protocol=_PICKLE_PROTOCOL)
        self.buf = buf
        self.names = names
        self.sources: dict[str, Source] = {}
        self._keys: dict[int, str] = {}
        self._dtypes: dict[int, torch.dtype] = {}
        self._tensors_by_storage: dict[int, list[tuple[str, torch.Tensor, int]]] = {}
        self._fast = fast
        self._armed: Any = None  # the storage a fast reduction just placed in its arguments, until its id
        self._armed_pid: Any = None
        if fast:  # else the C pickler calls the class's persistent_id (storage_id) for every object
            self._set_pid(_NO_ID)

    def _set_pid(self, fn: Any) -> None:
        _PERSISTENT_ID.__set__(self, fn)  # the C pickler's own slot: no Python call when it is the no-op

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is OrderedDict and self._fast and not obj and not obj.__dict__:
            # a tensor's empty backward hooks: what OrderedDict.__reduce__ gives for an attribute-less one
            return _EMPTY_ORDERED_DICT
        if not isinstance(obj, torch.Tensor):
            if self._fast and _is_storage(obj):
                raise _NeedPlainPath
            return NotImplemented
        name = self.names.get(id(obj))
        if name is None:  # built only when needed: this runs for every tensor
            name = f"<tensor inside an object, shape {tuple(obj.shape)}>"
        refuse_unsupported(obj, name)
        storage = obj.untyped_storage()
        self._tensors_by_storage.setdefault(storage._cdata, []).append((name, obj, obj._version))  # hot: inline
        if not (self._fast and _has_fast_reduce(obj)):
            return NotImplemented
        dtype = obj.dtype
        storage_type, itemsize = _typed(dtype)
        self._armed = storage
        self._armed_pid = self._record(storage, dtype, storage_type, storage.nbytes() // itemsize)
        self._set_pid(self._armed_id)
        args: tuple[Any, ...] = (
            storage,
            obj.storage_offset(),
            tuple(obj.size()),
            obj.stride(),
            obj.requires_grad,
            OrderedDict(),
        )
        metadata = _tensor_metadata(obj)
        if metadata:
            args += (metadata,)
        return (_rebuild_tensor_v2, args)

    def _armed_id(self, obj: Any) -> Any:
        # Sees the rebuild function, the argument tuple, then the storage (pickle's save_reduce order).
        if obj is not self._armed:
            return None
        self._armed = None
        self._set_pid(_NO_ID)
        return self._armed_pid

    def storage_id(self, obj: Any) -> Any:
        """torch.save's persistent_id: the record of a storage, None for anything else."""
        if not _is_storage(obj):
            return None
        if isinstance(obj, TypedStorage):
            return self._record(
                obj._untyped_storage, obj.dtype, getattr(torch, obj._pickle_storage_type()), obj._size()
            )
        return self._record(obj, torch.uint8, normalize_storage_type(type(obj)), obj.nbytes())

    persistent_id = storage_id

    def _record(self, storage: torch.UntypedStorage, dtype: torch.dtype, storage_type: Any, numel: int) -> Any:
        if storage.device.type == "meta":
            raise SaveRefusedError("meta storages have no data to save; materialize them first")
        ptr = storage.data_ptr()
        if ptr != 0 and self._dtypes.setdefault(ptr, dtype) != dtype:
            raise SaveRefusedError(
                "Cannot save multiple tensors or storages that view the same data as different types "
                "(torch.save refuses this too)"
            )
        cdata = storage._cdata
        key = self._keys.setdefault(cdata, str(len(self._keys)))
        if key not in self.sources:
            self.sources[key] = Source(key, storage, storage.nbytes(), self._tensors_by_storage.get(cdata, []))
        return ("storage", storage_type, key, _location(storage.device), numel)


class _NeedPlainPath(Exception):
    """The fast pickling path met a storage it cannot give an id to: pickle again on the plain path."""


TypedStorage = torch.storage.TypedStorage
_EMPTY_ORDERED_DICT = (OrderedDict, ())
_rebuild_tensor_v2 = torch._utils._rebuild_tensor_v2
_tensor_metadata: Any = getattr(torch._C, "_get_tensor_metadata")  # noqa: B009 (torch._utils.get_tensor_metadata, unchecked)
_NO_ID: Any = collections.deque(maxlen=0).append  # a C callable returning None: "not a storage" at C speed
_PERSISTENT_ID: Any = pickle.Pickler.__dict__.get("persistent_id")  # the C slot's data descriptor (CPython)
_V3_DTYPES = frozenset(torch.storage._new_dtypes())


def _is_storage(obj: Any) -> bool:
    """torch.save's test of a storage (``persistent_id``), once per type: both parts depend on the type only."""
    cls = type(obj)
    is_storage = _IS_STORAGE.get(cls)
    if is_storage is None:
        is_storage = _IS_STORAGE[cls] = isinstance(obj, TypedStorage) or torch.is_storage(obj)
    return is_storage


_TYPED: dict[torch.dtype, tuple[Any, int]] = {}
_LOCATIONS: dict[torch.device, str] = {}


def _typed(dtype: torch.dtype) -> tuple[Any, int]:
    """The storage class torch.save names for ``dtype`` (``torch.FloatStorage``) and its item size."""
    typed = _TYPED.get(dtype)
    if typed is None:
        name = torch.storage._dtype_to_storage_type_map()[dtype]  # TypedStorage._pickle_storage_type
        typed = _TYPED[dtype] = (getattr(torch, name), torch.empty((), dtype=dtype).element_size())
    return typed


def _location(device: torch.device) -> str:
    tag = _LOCATIONS.get(device)
    if tag is None:
        tag = _LOCATIONS[device] = location_tag(torch.UntypedStorage(0, device=device))
    return tag


def _has_storage(t: torch.Tensor) -> bool:
    try:
        t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _has_fast_reduce(t: torch.Tensor) -> bool:
    """Whether ``Tensor.__reduce_ex__`` would take its plain branch for ``t`` (and warn about nothing)."""
    return (
        type(t) is torch.Tensor
        and not t.__dict__
        and t._backward_hooks is None
        and t.device.type in ("cpu", "cuda")
        and t.dtype not in _V3_DTYPES
        and not t.is_sparse
    )


def _pickle(obj: Any, names: dict[int, str], fast: bool) -> _Pickler:
    pickler = _Pickler(io.BytesIO(), names, fast=fast)
    pickler.dump(obj)
    return pickler


def _fast_path_works() -> bool:
    """Whether this interpreter lets the pickler's persistent-id slot change during a dump and the fast
    path writes torch.save's bytes (checked once per process on a sample of every case it handles)."""
    if _PERSISTENT_ID is None or not hasattr(_PERSISTENT_ID, "__set__"):
        return False
    base = torch.arange(6, dtype=torch.float32)
    with_attribute = torch.nn.Module().state_dict()  # an OrderedDict with a _metadata attribute
    sample = {
        "t": base,
        "view": base[1:4],
        "again": base,
        "grad": torch.ones(2, requires_grad=True),
        "conj": torch.ones(2, dtype=torch.complex64).conj(),
        "p": torch.nn.Parameter(torch.zeros(3)),
        "half": torch.zeros(0, dtype=torch.bfloat16),
        "n": [1, 2.0, "x", None, (3,)],
        "empty": OrderedDict(),
        "with_attribute": with_attribute,
    }
    try:
        names = tensor_names(sample)
        fast, plain = _pickle(sample, names, True), _pickle(sample, names, False)
    except Exception:
        return False
    return fast.buf.getvalue() == plain.buf.getvalue() and list(fast.sources) == list(plain.sources)


_FAST: list[bool] = []  # [whether the fast path is used], decided at the first save of the process


def flatten_torch(obj: Any) -> tuple[bytes, list[Source]]:
    """Pickle ``obj`` as torch.save would; return the pickle and the storages in record order."""
    if not _FAST:
        _FAST.append(_fast_path_works())
    names = tensor_names(obj)
    try:
        try:
            pickler = _pickle(obj, names, fast=_FAST[0])
        except _NeedPlainPath:
            pickler = _pickle(obj, names, fast=False)
    except SaveRefusedError:
        raise
    except Exception as exc:
        raise SaveRefusedError(
            f"cannot pickle the object passed to save(): {exc}. Everything except tensors must be picklable "
            "(as for torch.save); convert or drop the offending value."
        ) from exc
    return pickler.buf.getvalue(), list(pickler.sources.values())
