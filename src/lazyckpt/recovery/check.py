"""Checking a checkpoint path of any kind (file, folder checkpoint, directory, URL) for
``lazyckpt verify`` and for ``lazyckpt.latest()``'s folder candidates. Files: ``verify.py``; DCP
folders: ``dcp.py``; Accelerate folders and pending markers: ``files.py``. Nothing from the files
is executed, and no framework is imported.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field
from typing import Any

from lazyckpt.commit import remote_folder as _remote_folder
from lazyckpt.core.remote import filesystem
from lazyckpt.formats.dcp import DATA_SUFFIX, MANIFEST, METADATA

from . import files as _files
from .dcp import partial_problem, read_manifest, verify_checkpoint
from .verify import verify as verify_file

__all__ = ["Result", "check", "check_path", "check_url", "folder_problems"]


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


def check(path: str, storage_options: dict[str, Any] | None = None) -> list[Result]:
    """Results for one path or URL (several for a directory or a prefix)."""
    return check_url(path, storage_options) if "://" in path else check_path(path)


def check_path(path: str) -> list[Result]:
    """Results for one command-line argument (several for a directory)."""
    if not os.path.exists(path):
        return [Result(path, "missing", problems=["no such file or directory"])]
    if not os.path.isdir(path):
        if path.endswith(DATA_SUFFIX):  # one item file of many: only its folder's manifest can vouch for it
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
    """A folder checkpoint at a URL: its manifest, then each checkpoint file it names."""
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
    try:
        report = verify_checkpoint(directory, storage_options)
    except OSError as exc:
        return Result(directory, "dcp-folder", problems=[f"cannot read: {exc}"])
    return Result(directory, "dcp-folder", report.format, report.size, report.records, list(report.problems))


def _is_dcp_object(name: str) -> bool:
    return name in (MANIFEST, METADATA) or name.endswith(DATA_SUFFIX)


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
    if os.path.isfile(os.path.join(directory, MANIFEST)):
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


def folder_problems(path: str, storage_options: dict[str, Any] | None = None, verify: bool = True) -> list[str]:
    """Why the folder checkpoint at ``path`` (local folder or URL prefix) is not complete and
    intact; ``[]`` when it is. Complete: no pending marker locally, or the last-uploaded key (folder
    manifest or DCP ``.metadata``) at a prefix. ``verify`` also checks every file as ``check`` does.
    A node-local DCP folder (one node's ranks only) is reported as a problem."""
    problems = _folder_problems(path, storage_options, verify)
    if not problems:
        partial = _partial(path, storage_options)
        if partial is not None:
            problems.append(partial)
    return problems


def _partial(path: str, storage_options: dict[str, Any] | None) -> str | None:
    try:
        manifest = read_manifest(path, storage_options)
    except (OSError, ValueError):  # not a lazyckpt DCP folder
        return None
    return partial_problem(manifest)


def _folder_problems(path: str, storage_options: dict[str, Any] | None, verify: bool) -> list[str]:
    if "://" in path:
        fs, rpath = filesystem(path, storage_options)
        rpath = rpath.rstrip("/")
        fs.invalidate_cache(rpath)
        if not any(fs.exists(f"{rpath}/{last}") for last in (_remote_folder.MANIFEST, METADATA)):
            return [f"neither {_remote_folder.MANIFEST} nor {METADATA}: its upload never finished"]
        results = check_url(path, storage_options) if verify else []
    else:
        if not os.path.isdir(path):
            return ["not a folder"]
        incomplete = _files.incomplete_problem(path)
        if incomplete:
            return [incomplete]
        if not os.listdir(path):
            return ["empty folder"]
        results = check_path(path) if verify else []
    return [p if r.path == path else f"{os.path.basename(r.path)}: {p}" for r in results for p in r.problems]
