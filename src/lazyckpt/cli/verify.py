"""``lazyckpt verify PATH...``: are these checkpoints intact? Exit 0 when all are, 1 otherwise.

Files go through :func:`lazyckpt.verify` (torch.save zips: every CRC32, the zip layout, the pickle
walked without running it; safetensors: header, bounds, lazyckpt's CRC when present). A directory
is searched recursively; every folder is checked for an unfinished lazyckpt folder save (a pending
marker: ``lazyckpt.is_complete``), and an Accelerate ``save_state`` folder also for every expected
file. A distributed checkpoint folder (``lazyckpt.distributed``: a ``.lazyckpt-manifest.json``
beside DCP's ``.metadata``) is checked as a whole by ``lazyckpt.distributed.verify_checkpoint``
(every data file's size and CRC32, every item's bounds); a ``*.distcp`` file given alone stands
for its folder. Nothing from the files is executed.

A URL (``s3://bucket/run/step-100.pt``, any fsspec URL) is checked by ranged reads, never
downloaded to disk; a URL prefix (``s3://bucket/run/``) checks every checkpoint object under it
(hidden keys, such as a lazyckpt upload's temporary key on non-S3 stores, are skipped). A prefix
holding a distributed checkpoint (``.metadata``, ``*.distcp``, the manifest) is checked as one
folder: without ``.metadata`` (uploaded last) it is not a committed checkpoint. A folder checkpoint
uploaded by lazyckpt (an Accelerate ``save_state`` folder: ``.lazyckpt-complete``, uploaded last,
names every file and its size) is checked against that manifest, and an Accelerate folder at a URL
without one is incomplete.
Credentials and endpoints come from the environment (``AWS_*``), or ``--storage-options JSON``.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from lazyckpt import verify as verify_file

from . import _files
from ._format import dump_json, human_bytes


@dataclass
class Result:
    """One line of output: a file, a folder's structure, or a path that could not be checked."""

    path: str
    # "file", "dcp-folder", "accelerate-folder", "folder", "directory", "missing" or "temporary" (a note, not checked)
    kind: str
    format: str = ""
    size: int | None = None
    records: int | None = None
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "ok": self.ok}


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "verify",
        help="check that checkpoint files / folders are intact (exit 0 ok, 1 damaged)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("paths", nargs="+", metavar="PATH", help="checkpoint file, Accelerate folder, or directory")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of lines")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the failures and the summary")
    p.add_argument(
        "--storage-options", type=json.loads, default=None, metavar="JSON",
        help='fsspec options for URLs, e.g. \'{"client_kwargs": {"endpoint_url": "http://..."}}\'',
    )  # fmt: skip
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    options = getattr(args, "storage_options", None)
    results = [r for path in args.paths for r in (check_url(path, options) if "://" in path else check_path(path))]
    checked = [r for r in results if r.kind != "temporary"]
    failed = [r for r in checked if not r.ok]
    if args.json:
        doc = {"ok": not failed, "checked": len(checked), "failed": len(failed)}
        dump_json({**doc, "results": [r.to_json() for r in results]})
    else:
        for r in results:
            if not (args.quiet and r.ok):
                print(_line(r))
        summary = f"{len(checked) - len(failed)} of {len(checked)} OK" + (f", {len(failed)} FAILED" if failed else "")
        print(summary)
    return 1 if failed else 0


def check_path(path: str) -> list[Result]:
    """Results for one command-line argument (several for a directory)."""
    if not os.path.exists(path):
        return [Result(path, "missing", problems=["no such file or directory"])]
    if not os.path.isdir(path):
        if path.endswith(_DCP_SUFFIX):  # one item file of many: only its folder's manifest can vouch for it
            return [check_dcp_folder(os.path.dirname(os.path.abspath(path)))]
        return [check_file(path)]
    results: list[Result] = []
    for directory, subdirs, _names in os.walk(path):
        staging = sorted(d for d in subdirs if _is_dcp_staging(d))
        results.extend(_dcp_staging_note(os.path.join(directory, d)) for d in staging)
        subdirs[:] = sorted(d for d in subdirs if d not in staging)
        results.extend(_check_directory(directory))
    if not any(r.kind in ("file", "dcp-folder") for r in results):
        suffixes = ", ".join(f"*{s}" for s in _files.CHECKPOINT_SUFFIXES)
        results.append(Result(path, "directory", problems=[f"no checkpoint files found (looked for {suffixes})"]))
    return results


def check_url(url: str, storage_options: dict[str, Any] | None = None) -> list[Result]:
    """An object in a store (checked by ranged reads), or every checkpoint object under a prefix."""
    from lazyckpt.storage.remote import filesystem

    try:
        fs, rpath = filesystem(url, storage_options)
        fs.invalidate_cache(rpath)  # listings cached by this process may be stale
        if not fs.isdir(rpath):
            if not fs.exists(rpath):
                return [Result(url, "missing", problems=["no such object"])]
            return [check_file(url, storage_options)]
        protocol = url.split("://", 1)[0]
        keys = fs.find(rpath)
        dcp = sorted({os.path.dirname(p) for p in keys if _is_dcp_object(os.path.basename(p))})
        # folder checkpoints: a manifest, or Accelerate's per-process RNG files (then incomplete without one)
        folders = sorted({os.path.dirname(p) for p in keys if _is_folder_object(os.path.basename(p))} - set(dcp))
        found = sorted(
            p
            for p in keys
            if _files.is_checkpoint_name(os.path.basename(p)) and os.path.dirname(p) not in (*dcp, *folders)
        )
    except Exception as exc:  # noqa: BLE001 - one line per argument, whatever the store said
        return [Result(url, "missing", problems=[f"cannot read: {exc}"])]
    if not found and not dcp and not folders:
        return [Result(url, "directory", problems=["no checkpoint objects found under this prefix"])]
    results = [check_dcp_folder(f"{protocol}://{p.lstrip('/')}", storage_options) for p in dcp]
    for p in folders:
        results.extend(check_url_folder(fs, p, f"{protocol}://{p.lstrip('/')}", storage_options))
    return results + [check_file(f"{protocol}://{p.lstrip('/')}", storage_options) for p in found]


def check_url_folder(fs: Any, rpath: str, url: str, storage_options: dict[str, Any] | None) -> list[Result]:
    """A folder checkpoint at a URL: its manifest (every named file present, with its size), then
    each checkpoint file it names (CRCs by ranged reads)."""
    from lazyckpt.commit import remote_folder as _remote_folder

    problems, urls, total = _remote_folder.check(fs, rpath, url)
    folder = Result(url, "folder", "manifest", total, len(urls), problems)
    files = [check_file(u, storage_options) for u in urls if _files.is_checkpoint_name(os.path.basename(u))]
    return [folder, *files]


def _is_folder_object(name: str) -> bool:
    return name == ".lazyckpt-complete" or (name.startswith("random_states_") and name.endswith(".pkl"))


def check_file(path: str, storage_options: dict[str, Any] | None = None) -> Result:
    try:
        report = verify_file(path, storage_options) if "://" in path else verify_file(path)
    except OSError as exc:
        return Result(path, "file", problems=[f"cannot read: {exc.strerror or exc}"])
    result = Result(path, "file", report.format, report.size, report.records, list(report.problems))
    if report.format == "unknown" and not result.problems:  # pragma: no cover - verify() always says why
        result.problems.append("not a checkpoint (neither a torch.save zip nor safetensors)")
    return result


def check_dcp_folder(directory: str, storage_options: dict[str, Any] | None = None) -> Result:
    """A ``lazyckpt.distributed`` checkpoint folder (or URL prefix), checked against its manifest."""
    from lazyckpt.distributed import verify_checkpoint  # torch.distributed.checkpoint: only when needed

    try:
        report = verify_checkpoint(directory, storage_options)
    except OSError as exc:
        return Result(directory, "dcp-folder", problems=[f"cannot read: {exc}"])
    return Result(directory, "dcp-folder", report.format, report.size, report.records, list(report.problems))


_DCP_MANIFEST = ".lazyckpt-manifest.json"  # lazyckpt.distributed._commit.MANIFEST
_DCP_SUFFIX = ".distcp"


def _is_dcp_object(name: str) -> bool:
    """An object of a distributed checkpoint at a URL (its prefix is checked as one folder)."""
    return name in (_DCP_MANIFEST, ".metadata") or name.endswith(_DCP_SUFFIX)


def _is_dcp_staging(name: str) -> bool:
    """A distributed save's staging folder (``.<name>.lazyckpt-dist-<token>-<n>[-old].tmp``)."""
    return name.startswith(".") and ".lazyckpt-dist-" in name and name.endswith(".tmp")


def _dcp_staging_note(path: str) -> Result:
    note = (
        "lazyckpt distributed staging folder: a save in progress, or left by a killed job "
        "(the next distributed save into this folder removes it)"
    )
    return Result(path, "temporary", notes=[note])


def _check_directory(directory: str) -> list[Result]:
    results: list[Result] = []
    if os.path.isfile(os.path.join(directory, _DCP_MANIFEST)):
        results.append(check_dcp_folder(directory))
    elif _files.is_accelerate_folder(directory):
        folder = _files.check_accelerate_folder(directory)
        results.append(Result(directory, "accelerate-folder", "accelerate", records=len(folder.files),
                              problems=folder.problems))  # fmt: skip
    else:
        incomplete = _files.incomplete_problem(directory)
        if incomplete:  # a folder checkpoint of another kind (not Accelerate's names)
            results.append(Result(directory, "folder", problems=[incomplete]))
        results.extend(_temporary_note(tmp) for tmp in _files.temporaries(directory))
    results.extend(check_file(f) for f in _files.checkpoint_files(directory))
    return results


def _temporary_note(path: str) -> Result:
    note = "lazyckpt temporary: a save in progress, or left by a killed process (cleanup_temporaries() removes it)"
    return Result(path, "temporary", notes=[note])


def _line(r: Result) -> str:
    status = "OK  " if r.ok else "FAIL"
    if r.kind == "temporary":
        status = "NOTE"
    details = [d for d in (r.format, human_bytes(r.size) if r.size is not None else "") if d]
    if r.records is not None:
        unit = {"accelerate-folder": "files", "folder": "files", "dcp-folder": "items"}.get(r.kind, "records")
        details.append(f"{r.records} {unit}")
    text = f"{status}  {r.path}" + (f"  ({', '.join(details)})" if details else "")
    messages = r.problems or r.notes
    return text + (": " + "; ".join(messages) if messages else "")
