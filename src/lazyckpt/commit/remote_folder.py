"""Folder checkpoints at URLs: every file of a complete local folder, then ``.lazyckpt-complete`` (a
JSON manifest of names and sizes) last (``commit/prefix.py``). Readers refuse a prefix without a
manifest and read only the files it names. Runs on the caller's thread.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Protocol

from lazyckpt.commit.prefix import Prefix
from lazyckpt.core import remote as _remote
from lazyckpt.core.remote import RemoteTier
from lazyckpt.errors import IncompleteCheckpointError, UploadError
from lazyckpt.options import CheckpointerOptions


class Checkpointer(Protocol):
    """What folder saves at URLs need: a producer (``lazyckpt.checkpointer.producer_of``)."""

    @property
    def options(self) -> CheckpointerOptions: ...

    def remote_tier(self) -> RemoteTier: ...


MANIFEST = ".lazyckpt-complete"
_FORMAT = "lazyckpt-folder/1"
_SKIP_PREFIX = ".lazyckpt-"  # markers and temporaries of the local folder protocol: never uploaded


def _join(base: str, rel: str) -> str:
    return base.rstrip("/") + "/" + rel


def local_folder(checkpointer: Checkpointer, url: str) -> str:
    """A fresh folder in the checkpointer's local tier for one folder save to ``url``."""
    tier = checkpointer.remote_tier()
    _fs, rpath = tier.resolve(url)
    path = tier.local_path(rpath)  # <local_dir>/.uploads/<pid>-<n>/<name>: its parent is fresh
    os.makedirs(path)
    return path


def files_of(folder: str) -> list[str]:
    """Relative paths (``/``-separated) of the folder's files, markers and temporaries left out."""
    out = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith(_SKIP_PREFIX) or name.startswith("."):
                continue
            out.append(os.path.relpath(os.path.join(root, name), folder).replace(os.sep, "/"))
    return out


def upload(checkpointer: Checkpointer, folder: str, url: str) -> dict[str, Any]:
    """Upload the complete local ``folder`` to ``url``, the manifest last; returns the manifest.

    Raises ``UploadError`` (the local folder is kept). On success the local copy is removed, or
    mirrored with ``keep_local``."""
    manifest, prefix = upload_folder(checkpointer.remote_tier(), folder, url)
    prefix.finish_local()
    return manifest


def upload_folder(tier: RemoteTier, folder: str, url: str, scratch: str | None = None) -> tuple[dict[str, Any], Prefix]:
    """Upload ``folder``'s files to ``url``, then the manifest, written in ``scratch`` (default
    ``folder``). Local files stay (``Prefix.finish_local``). Raises ``UploadError`` after deleting
    what it uploaded; ``url`` then holds no checkpoint."""
    prefix = Prefix.at(tier, url, MANIFEST, local=folder)
    try:
        prefix.hide_previous()  # no old manifest while files change
        files = files_of(folder)
        for rel in files:
            prefix.upload(rel)
        manifest = {"format": _FORMAT, "files": {rel: os.path.getsize(os.path.join(folder, rel)) for rel in files}}
        manifest_path = os.path.join(scratch or folder, MANIFEST)
        with open(manifest_path, "w") as fh:
            json.dump(manifest, fh, indent=1, sort_keys=True)
        prefix.upload_from(MANIFEST, manifest_path)
    except Exception as exc:
        prefix.remove_uploaded()  # best effort: without the manifest they are no checkpoint anyway
        raise UploadError(
            f"upload of the folder checkpoint {url} failed ({exc}); no manifest was written, so {url} holds "
            f"no checkpoint; the local copy is kept at {folder}",
            url, attempts=getattr(exc, "attempts", 0), local_path=folder,
        ) from exc  # fmt: skip
    return manifest, prefix


def read_manifest(fs: Any, rpath: str, url: str) -> dict[str, Any]:
    """The manifest of the folder checkpoint at ``url``; ``IncompleteCheckpointError`` without one."""
    _remote.invalidate(fs, rpath)
    try:
        with fs.open(_join(rpath, MANIFEST), "rb") as fh:
            manifest = json.loads(fh.read())
    except FileNotFoundError:
        raise IncompleteCheckpointError(
            f"lazyckpt: {url!r} holds no complete folder checkpoint: its manifest {MANIFEST} is missing "
            "(the save never finished its upload, or the prefix was not written by lazyckpt)."
        ) from None
    if manifest.get("format") != _FORMAT or not isinstance(manifest.get("files"), dict):
        raise IncompleteCheckpointError(f"lazyckpt: {_join(url, MANIFEST)!r} is not a lazyckpt folder manifest")
    return manifest


def download(checkpointer: Checkpointer, url: str, dest: str) -> list[str]:
    """Copy the folder checkpoint at ``url`` (the files its manifest names) into ``dest``."""
    tier = checkpointer.remote_tier()
    fs, rpath = tier.resolve(url)
    manifest = read_manifest(fs, rpath, url)
    out = []
    for rel, size in manifest["files"].items():
        local = os.path.join(dest, *rel.split("/"))
        os.makedirs(os.path.dirname(local), exist_ok=True)
        _remote.retry(f"download of {_join(url, rel)}", functools.partial(fs.get_file, _join(rpath, rel), local),
                       url, checkpointer.options)  # fmt: skip
        if os.path.getsize(local) != size:
            raise IncompleteCheckpointError(
                f"lazyckpt: {_join(url, rel)!r} has {os.path.getsize(local)} bytes, its manifest says {size}"
            )
        out.append(local)
    return out


def check(fs: Any, rpath: str, url: str) -> tuple[list[str], list[str], int]:
    """For ``lazyckpt verify``: (problems, URLs of the files the manifest names, their total size)."""
    try:
        manifest = read_manifest(fs, rpath, url)
    except IncompleteCheckpointError as exc:
        return [str(exc)], [], 0
    problems, urls, total = [], [], 0
    for rel, size in sorted(manifest["files"].items()):
        try:
            actual = fs.info(_join(rpath, rel))["size"]
        except FileNotFoundError:
            problems.append(f"{rel}: named by the manifest, missing from the store")
            continue
        if actual != size:
            problems.append(f"{rel}: {actual} bytes in the store, the manifest says {size}")
        urls.append(_join(url, rel))
        total += size
    return problems, urls, total
