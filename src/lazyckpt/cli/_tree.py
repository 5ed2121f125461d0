"""The key tree of a loaded checkpoint: JSON-ready nodes, totals, largest tensors, terminal lines.

A node is a dict: tensors ``{"type": "tensor", "dtype", "shape", "bytes"}``; containers (dict, list,
tuple) ``{"type", "entries", "tensors", "bytes", "children": [{"key", **node}]}``; anything else
``{"type": <class name>, "value": <short repr>}``. Only dicts, lists and tuples are walked.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ._format import human_bytes

_MAX_DEPTH = 64  # deeper structures are summarised, not walked
_VALUE_CHARS = 60

# safetensors dtype names -> torch's, so both formats read the same
_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64", "I32": "int32",
    "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "C64": "complex64", "U64": "uint64",
    "U32": "uint32", "U16": "uint16", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2",
}  # fmt: skip


class _Walk:
    """Accumulates totals while building the tree."""

    def __init__(self) -> None:
        self.tensors: list[dict[str, Any]] = []  # {"key", "dtype", "shape", "bytes", "elements"}
        self.storages: dict[object, int] = {}  # storage identity -> nbytes
        self.shared = 0  # tensors whose storage an earlier tensor already uses

    def node(self, obj: Any, key: str, depth: int) -> dict[str, Any]:
        import torch

        if isinstance(obj, torch.Tensor):
            return self._tensor(obj, key)
        if isinstance(obj, (dict, list, tuple)) and depth < _MAX_DEPTH:
            items = obj.items() if isinstance(obj, dict) else enumerate(obj)
            children = [{"key": str(k), **self.node(v, f"{key}/{k}" if key else str(k), depth + 1)} for k, v in items]
            return _container(type(obj).__name__, children)
        text = repr(obj)
        value = text if len(text) <= _VALUE_CHARS else text[: _VALUE_CHARS - 3] + "..."
        return {"type": type(obj).__name__, "value": value}

    def _tensor(self, t: Any, key: str) -> dict[str, Any]:
        dtype = str(t.dtype).removeprefix("torch.")
        nbytes = t.numel() * t.element_size()
        try:
            storage = t.untyped_storage()
            ptr, size = storage.data_ptr(), storage.nbytes()
            ident = (storage.device, ptr) if ptr else id(t)
        except (RuntimeError, NotImplementedError):  # sparse, nested, subclasses without one storage
            ident, size = id(t), nbytes
        if ident in self.storages:
            self.shared += 1
        self.storages[ident] = size
        self.tensors.append({"key": key, "dtype": dtype, "shape": list(t.shape), "bytes": nbytes,
                             "elements": t.numel()})  # fmt: skip
        return {"type": "tensor", "dtype": dtype, "shape": list(t.shape), "bytes": nbytes}

    def totals(self) -> dict[str, Any]:
        by_dtype: dict[str, int] = {}
        for t in self.tensors:
            by_dtype[t["dtype"]] = by_dtype.get(t["dtype"], 0) + t["bytes"]
        return {
            "tensors": len(self.tensors),
            "elements": sum(t["elements"] for t in self.tensors),
            "bytes": sum(self.storages.values()),  # what the file holds: each storage once
            "tensor_bytes": sum(t["bytes"] for t in self.tensors),
            "storages": len(self.storages),
            "tensors_sharing_storage": self.shared,
            "by_dtype": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1])),
        }


def _container(kind: str, children: list[dict[str, Any]]) -> dict[str, Any]:
    tensors = sum(1 if c["type"] == "tensor" else c.get("tensors", 0) for c in children)
    nbytes = sum(c.get("bytes", 0) for c in children)
    return {"type": kind, "entries": len(children), "tensors": tensors, "bytes": nbytes, "children": children}


def summarize(obj: Any) -> dict[str, Any]:
    """Tree, totals and the largest tensors of an object loaded by ``torch.load``."""
    walk = _Walk()
    tree = walk.node(obj, "", 0)
    largest = sorted(walk.tensors, key=lambda t: -t["bytes"])[:50]
    return {"tree": tree, "totals": walk.totals(), "largest": largest}


def summarize_safetensors(header: dict[str, Any]) -> dict[str, Any]:
    """The same summary from a safetensors JSON header (flat keys, no data read)."""
    metadata = header.pop("__metadata__", None)
    children, tensors = [], []
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = _ST_DTYPES.get(entry["dtype"], entry["dtype"])
        elements = 1
        for d in entry["shape"]:
            elements *= int(d)
        children.append({"key": name, "type": "tensor", "dtype": dtype, "shape": entry["shape"], "bytes": end - begin})
        tensors.append({"key": name, "dtype": dtype, "shape": entry["shape"], "bytes": end - begin,
                        "elements": elements})  # fmt: skip
    by_dtype: dict[str, int] = {}
    for t in tensors:
        by_dtype[t["dtype"]] = by_dtype.get(t["dtype"], 0) + t["bytes"]
    total = sum(t["bytes"] for t in tensors)
    totals = {"tensors": len(tensors), "elements": sum(t["elements"] for t in tensors), "bytes": total,
              "tensor_bytes": total, "storages": len(tensors), "tensors_sharing_storage": 0,
              "by_dtype": dict(sorted(by_dtype.items(), key=lambda kv: -kv[1]))}  # fmt: skip
    largest = sorted(tensors, key=lambda t: -t["bytes"])[:50]
    return {"metadata": metadata or {}, "tree": _container("dict", children), "totals": totals, "largest": largest}


def render(tree: dict[str, Any], max_depth: int = 4, max_children: int = 12) -> Iterator[str]:
    """Terminal lines for a tree: containers expanded to ``max_depth``, long ones cut after ``max_children``."""
    yield from _render_children(tree.get("children", []), 0, max_depth, max_children)


def _render_children(children: list[dict[str, Any]], depth: int, max_depth: int, max_children: int) -> Iterator[str]:
    indent = "  " * depth
    for child in children[:max_children]:
        yield indent + f"{child['key']}: {describe(child)}"
        if "children" in child and depth + 1 < max_depth:
            yield from _render_children(child["children"], depth + 1, max_depth, max_children)
    rest = children[max_children:]
    if rest:
        tensors = sum(1 if c["type"] == "tensor" else c.get("tensors", 0) for c in rest)
        nbytes = sum(c.get("bytes", 0) for c in rest)
        yield indent + f"... {len(rest)} more ({tensors} tensors, {human_bytes(nbytes)})"


def describe(node: dict[str, Any]) -> str:
    """One node on one line."""
    if node["type"] == "tensor":
        shape = "x".join(str(d) for d in node["shape"]) or "scalar"
        return f"{node['dtype']} [{shape}] {human_bytes(node['bytes'])}"
    if "children" in node:
        if not node["tensors"]:
            return f"{node['type']}, {node['entries']} entries"
        return f"{node['type']}, {node['entries']} entries, {node['tensors']} tensors, {human_bytes(node['bytes'])}"
    return f"{node['value']} ({node['type']})"
