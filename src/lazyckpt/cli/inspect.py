"""``lazyckpt inspect PATH``: what is inside a checkpoint, without running code from it.

torch.save files are loaded with ``weights_only=True`` and ``mmap=True`` (tensor data is not read);
files that need arbitrary Python objects are refused with what they need (``--unsafe`` loads them,
for files you trust only). safetensors files are read from their header alone. For a folder, every
checkpoint file in it is shown, with a warning when a lazyckpt save into it never finished.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import struct
import sys
from typing import Any

from lazyckpt.recovery import files as _files

from ..errors import InspectError
from . import _tree
from ._format import dump_json, human_bytes, table


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "inspect",
        help="show the keys, dtypes, shapes and sizes inside a checkpoint (and Lightning metadata)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("path", metavar="PATH", help="a torch.save / Lightning .ckpt / safetensors file, or a folder")
    p.add_argument("--json", action="store_true", help="print one JSON document (every tensor) instead of a tree")
    p.add_argument("--unsafe", action="store_true",
                   help="allow weights_only=False (runs code from the file: only for files you trust)")  # fmt: skip
    p.add_argument("--depth", type=int, default=4, help="tree levels to expand (default 4)")
    p.add_argument("--max-children", type=int, default=12, help="entries shown per level (default 12)")
    p.add_argument("--top", type=int, default=10, help="how many of the largest tensors to list (default 10)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    try:
        paths = _targets(args.path)
        reports = [inspect_file(path, unsafe=args.unsafe) for path in paths]
    except InspectError as exc:
        print(f"lazyckpt inspect: {exc}", file=sys.stderr)
        return 1
    if args.json:
        dump_json(reports[0] if len(reports) == 1 else {"files": reports})
        return 0
    for n, report in enumerate(reports):
        if n:
            print()
        _print_report(report, args)
    return 0


def _targets(path: str) -> list[str]:
    if not os.path.exists(path):
        raise InspectError(f"{path}: no such file or directory")
    if not os.path.isdir(path):
        return [path]
    files = _files.checkpoint_files(path)
    if not files:
        raise InspectError(f"{path}: no checkpoint files in this directory; pass a file")
    incomplete = _files.incomplete_problem(path)
    if incomplete:  # show it, but never as a whole checkpoint
        print(f"lazyckpt inspect: warning: {path}: {incomplete}", file=sys.stderr)
    return files


def inspect_file(path: str, unsafe: bool = False) -> dict[str, Any]:
    """A JSON-ready description of one checkpoint file."""
    with open(path, "rb") as fh:
        magic = fh.read(8)
    if magic[:4] == b"PK\x03\x04":
        obj, loaded_with = _load_torch(path, unsafe), "weights_only=False" if unsafe else "weights_only=True"
        report = {"path": path, "format": "torch", "loaded_with": loaded_with, **_tree.summarize(obj)}
        lightning = _lightning_metadata(obj)
        if lightning:
            report["lightning"] = lightning
        return report
    if len(magic) == 8:
        header = _safetensors_header(path, struct.unpack("<Q", magic)[0])
        if header is not None:
            return {"path": path, "format": "safetensors", **_tree.summarize_safetensors(header)}
    raise InspectError(f"{path}: not a checkpoint (neither a torch.save zip nor a safetensors file)")


def _load_torch(path: str, unsafe: bool) -> Any:
    import torch

    try:
        # mmap: no tensor data is read; "cpu" rather than "meta" keeps tied tensors on one storage
        return torch.load(path, mmap=True, map_location="cpu", weights_only=not unsafe)
    except pickle.UnpicklingError as exc:
        if unsafe or "Weights only load failed" not in str(exc):
            raise InspectError(f"{path}: cannot unpickle ({_first_line(exc)}); run `lazyckpt verify {path}`") from exc
        needs = _unsafe_globals(path)
        raise InspectError(
            f"{path} holds Python objects that safe loading (weights_only=True) refuses"
            + (f": {', '.join(needs)}" if needs else "")
            + f". Loading them runs code from the file. If you trust it: lazyckpt inspect --unsafe {path}"
        ) from exc
    except (RuntimeError, OSError, EOFError, ValueError) as exc:
        raise InspectError(f"{path}: torch.load failed ({_first_line(exc)}); run `lazyckpt verify {path}`") from exc


def _unsafe_globals(path: str) -> list[str]:
    import torch

    try:
        return list(torch.serialization.get_unsafe_globals_in_checkpoint(path))
    except Exception:  # older torch, or a damaged pickle: the refusal message still stands
        return []


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]


def _safetensors_header(path: str, length: int) -> dict[str, Any] | None:
    size = os.path.getsize(path)
    if length > min(size - 8, 100 << 20):
        return None
    with open(path, "rb") as fh:
        fh.seek(8)
        raw = fh.read(length)
    try:
        header = json.loads(raw)
    except ValueError:
        return None
    return header if isinstance(header, dict) else None


# Lightning ---------------------------------------------------------------------------------------

_LIGHTNING_SCALARS = ("epoch", "global_step", "pytorch-lightning_version", "hparams_name")


def _lightning_metadata(obj: Any) -> dict[str, Any] | None:
    """Epoch, step, versions and the names of the saved states of a Lightning checkpoint."""
    if not isinstance(obj, dict) or not any(k in obj for k in ("pytorch-lightning_version", "global_step")):
        return None
    meta: dict[str, Any] = {k: obj[k] for k in _LIGHTNING_SCALARS if k in obj}
    for key in ("callbacks", "loops", "hyper_parameters", "datamodule_hyper_parameters"):
        if isinstance(obj.get(key), dict):
            meta[key] = [str(k) for k in obj[key]]
    for key in ("optimizer_states", "lr_schedulers"):
        if isinstance(obj.get(key), list):
            meta[key] = len(obj[key])
    extra = [k for k in obj if k not in meta and k not in ("state_dict",)]
    if extra:
        meta["other_keys"] = [str(k) for k in extra]
    return meta


# terminal output ---------------------------------------------------------------------------------


def _print_report(report: dict[str, Any], args: argparse.Namespace) -> None:
    totals = report["totals"]
    print(f"{report['path']}  ({report['format']}, {human_bytes(os.path.getsize(report['path']))} on disk)")
    if report.get("loaded_with") == "weights_only=False":
        print("  loaded with weights_only=False (--unsafe)")
    lightning = report.get("lightning")
    if lightning:
        _print_lightning(lightning)
    if report.get("metadata"):
        print("metadata:")
        for key, value in report["metadata"].items():
            print(f"  {key}: {value}")
    print("tree:")
    for line in _tree.render(report["tree"], max_depth=args.depth, max_children=args.max_children):
        print("  " + line)
    shared = totals["tensors_sharing_storage"]
    print(
        f"totals: {totals['tensors']} tensors, {totals['elements']:,} elements, "
        f"{human_bytes(totals['bytes'])} of tensor data in {totals['storages']} storages"
        + (f" ({shared} tensors share a storage with another, e.g. tied weights)" if shared else "")
    )
    print("by dtype: " + ", ".join(f"{d} {human_bytes(b)}" for d, b in totals["by_dtype"].items()))
    largest = report["largest"][: args.top]
    if largest:
        print(f"largest {len(largest)} tensors:")
        rows = [(t["key"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", human_bytes(t["bytes"]))
                for t in largest]  # fmt: skip
        table(("key", "dtype", "shape", "bytes"), rows)


def _print_lightning(meta: dict[str, Any]) -> None:
    print("lightning:")
    for key, value in meta.items():
        if isinstance(value, list):
            print(f"  {key}: " + (", ".join(value) if value else "(none)"))
        else:
            print(f"  {key}: {value}")
