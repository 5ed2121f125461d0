"""The remote tier: a URL save is a local save into ``local_dir``, then an upload on the
``lazyckpt-upload`` thread, FIFO in save order (``storage/objects.py`` moves the bytes). Never log
``storage_options`` (credentials); messages name URLs only.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from lazyckpt.core.handle import CallbackRunner, Completion, Outcome, SaveHandle, SaveStats, wait_finished
from lazyckpt.core.removal import RemovalFuture
from lazyckpt.core.report import Report
from lazyckpt.errors import SaveRefusedError, UploadError
from lazyckpt.options import CheckpointerOptions
from lazyckpt.storage.objects import PartPool, S3Upload, generic_upload, retry, transient
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker

__all__ = ["RemoteSaveHandle", "RemoteTier", "retry", "transient"]  # retry, transient: re-exported

logger = logging.getLogger(__name__)

T = TypeVar("T")

_UPLOADS = ".uploads"  # inside local_dir: one folder per pending folder save, one for this process's files
_FILES = "-files"  # <local_dir>/.uploads/<pid>-files: the local copies of single-file URL saves
WARN_AFTER_S = 0.5  # a URL save that waited longer than this for uploads warns


def is_url(path: object) -> bool:
    """A str with a protocol (``s3://``, ``memory://``, ``file://``): saved through the remote tier."""
    return isinstance(path, str) and "://" in path


def filesystem(url: str, storage_options: dict[str, Any] | None) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it); ``SaveRefusedError`` when no backend handles ``url``."""
    try:
        from fsspec.core import url_to_fs
    except ImportError as exc:
        raise SaveRefusedError(f"{url!r}: saving to URLs needs fsspec: pip install 'lazyckpt[s3]'") from exc
    try:
        return url_to_fs(url, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise SaveRefusedError(
            f"{url!r}: fsspec has no usable filesystem for it ({exc}). Install its backend "
            "(s3fs: pip install 'lazyckpt[s3]'; gcsfs, adlfs ...) or save to a local path."
        ) from exc


def is_s3(fs: Any) -> bool:
    return any(c.__name__ == "S3FileSystem" for c in type(fs).__mro__) and hasattr(fs, "call_s3")


class RemoteSaveHandle(SaveHandle):
    """The handle of a URL save: staged (host copies done), local (local copy committed), done (the
    object is complete in the store)."""

    def __init__(self, url: str, outcome: Outcome | None = None, *, local_handle: SaveHandle) -> None:
        super().__init__(url, outcome)
        self.url = url
        self.local_handle = local_handle

    def staged(self) -> bool:
        return self.local_handle.staged()

    def wait_staged(self, timeout: float | None = None) -> None:
        self.local_handle.wait_staged(timeout)

    def local(self) -> bool:
        return self.local_handle.done()

    def wait_local(self, timeout: float | None = None) -> SaveStats:
        return self.local_handle.wait(timeout)

    def wait_done(self, timeout: float | None = None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.local_handle.wait_done(timeout):  # confirms the local save on this thread
            return False
        return wait_finished(self, None if deadline is None else max(0.0, deadline - time.monotonic()))


@dataclass(eq=False)
class _Upload:
    url: str
    fs: Any
    rpath: str
    local_path: str
    completion: Completion  # of a RemoteSaveHandle
    nbytes: int  # counted in the backlog until the upload ends
    t0: float  # perf_counter at save()

    @property
    def handle(self) -> RemoteSaveHandle:
        return self.completion.handle  # type: ignore[return-value]


@dataclass(eq=False)
class _Deletion:
    url: str
    fs: Any
    rpath: str
    # an error fetched through this future is claimed: wait() does not raise it again
    future: RemovalFuture = field(default_factory=RemovalFuture)


class RemoteTier:
    """Owns the local tier's folder, the upload threads, and the URL saves not yet in the store.
    Callable from any thread; the upload thread touches only its items and ``_cond``-guarded counters."""

    def __init__(self, options: CheckpointerOptions, publish: Callable[[Report], None], callbacks: CallbackRunner):
        self.options = options
        self._publish = publish  # the checkpointer's ledger: an upload's error is reported once
        self._callbacks = callbacks
        self._owns_dir = options.local_dir is None
        self.local_dir = (
            tempfile.mkdtemp(prefix="lazyckpt-local-") if self._owns_dir else os.path.abspath(options.local_dir or "")
        )
        os.makedirs(os.path.join(self.local_dir, _UPLOADS), exist_ok=True)
        _remove_dead_leftovers(os.path.join(self.local_dir, _UPLOADS))
        # made once: a folder per save would be a directory create on the training thread
        self._files_dir = os.path.join(self.local_dir, _UPLOADS, f"{os.getpid()}{_FILES}")
        os.makedirs(self._files_dir, exist_ok=True)
        free = shutil.disk_usage(self.local_dir).free
        self.backlog_bound = int(options.upload_backlog_bytes or max(free // 2, 1 << 30))
        self._started_at = time.time()
        self._cond = reentry.condition()
        self._pending: list[_Upload | _Deletion] = []  # in queue order
        self._backlog = 0  # local bytes not yet in the store
        self.wait_s = 0.0  # save() waited for uploads since the last warning
        self.uploaded_bytes = 0
        self.upload_s = 0.0
        self._counter = itertools.count()
        self._filesystems: dict[str, Any] = {}
        self._parts = PartPool(options.upload_threads)
        self._uploads: Worker[_Upload | _Deletion] = Worker("lazyckpt-upload", self._run_item)

    # -- caller side ------------------------------------------------------------------------------

    def resolve(self, url: str) -> tuple[Any, str]:
        """(filesystem, path) for ``url``: one cached fsspec instance per protocol (chained ``a::b``
        and query URLs are resolved each time)."""
        protocol = url.split("://", 1)[0]
        if "::" in url or "?" in url:
            return filesystem(url, self.options.storage_options)
        with self._cond:
            fs = self._filesystems.get(protocol)
        if fs is None:
            fs, rpath = filesystem(url, self.options.storage_options)
            with self._cond:
                self._filesystems[protocol] = fs
            return fs, rpath
        from fsspec.core import strip_protocol  # (fsspec is imported: filesystem() made fs)

        return fs, strip_protocol(url)  # fs's class strips: the protocol's registered one

    def local_file(self, rpath: str) -> str:
        """A fresh local path for one single-file save (nothing is created here)."""
        name = os.path.basename(rpath.rstrip("/")) or "checkpoint"
        return os.path.join(self._files_dir, f"{next(self._counter):06d}-{name}")

    def local_path(self, rpath: str) -> str:
        """A fresh local path, in a folder of its own, for one folder save (its parent is new)."""
        folder = os.path.join(self.local_dir, _UPLOADS, f"{os.getpid()}-{next(self._counter):06d}")
        os.makedirs(folder)
        return os.path.join(folder, os.path.basename(rpath.rstrip("/")) or "checkpoint")

    def admit(self, skip: bool) -> bool:
        """Before a URL save: wait while the upload backlog is at its bound (return False instead
        when ``skip``)."""
        with self._cond:
            if self._backlog < self.backlog_bound:
                return True
            if skip:
                return False
            t = time.monotonic()
            while self._backlog >= self.backlog_bound and self._pending:
                self._cond.wait()
            self.wait_s += time.monotonic() - t
            return True

    def take_wait_s(self) -> float:
        """Seconds ``admit`` waited since the last call (the caller warns with them)."""
        with self._cond:
            waited, self.wait_s = self.wait_s, 0.0
        return waited

    def backlog(self) -> int:
        with self._cond:
            return self._backlog

    def register(self, url: str, fs: Any, rpath: str, local: SaveHandle, nbytes: int, t0: float) -> RemoteSaveHandle:
        completion = Completion(url, RemoteSaveHandle, local_handle=local)
        item = _Upload(url, fs, rpath, local.path, completion, nbytes, t0)
        handle = item.handle
        with self._cond:
            self._pending.append(item)
            self._backlog += nbytes
        self._uploads.submit(item)
        return handle

    def remove(self, url: str, fs: Any, rpath: str) -> RemovalFuture:
        """Delete ``url`` after every upload queued before (in particular, to it)."""
        item = _Deletion(url, fs, rpath)
        with self._cond:
            self._pending.append(item)
        self._uploads.submit(item)
        return item.future

    def pending_urls(self) -> set[str]:
        with self._cond:
            return {i.url for i in self._pending if isinstance(i, _Upload)}

    def pending_handles(self, url: str | None = None) -> list[SaveHandle]:
        with self._cond:
            return [i.handle for i in self._pending if isinstance(i, _Upload) and url in (None, i.url)]

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until everything queued so far has finished; False on timeout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            items = list(self._pending)
            while any(i in self._pending for i in items):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Finish what is queued, stop the threads, remove the local tier's temporary files."""
        self._uploads.stop()
        self._parts.stop()
        if self._owns_dir and not self.options.keep_local:
            shutil.rmtree(self.local_dir, ignore_errors=True)
        else:
            for folder in (self._files_dir, os.path.join(self.local_dir, _UPLOADS)):
                with contextlib.suppress(OSError):
                    os.rmdir(folder)

    # -- upload thread ----------------------------------------------------------------------------

    def _run_item(self, item: _Upload | _Deletion) -> None:
        try:
            if isinstance(item, _Deletion):
                self._delete(item)
            else:
                self._upload(item)
        except BaseException:  # noqa: BLE001 - the worker survives one failed item
            logger.exception("lazyckpt: remote tier item for %s failed", item.url)
        finally:
            with self._cond:
                self._pending.remove(item)
                if isinstance(item, _Upload):
                    self._backlog -= item.nbytes
                self._cond.notify_all()

    def _delete(self, item: _Deletion) -> None:
        try:
            self.delete_object(item.url, item.fs, item.rpath)
            item.future.set_result(None)
        except BaseException as exc:  # noqa: BLE001 - reaches the caller through the future / the ledger
            item.future.fail(exc, self._publish)  # one report, shared by the future and the ledger

    def _upload(self, item: _Upload) -> None:
        local = item.handle.local_handle
        wait_finished(local)  # committed by the local engine; confirmed by the training's thread, never here
        stats = local.stats
        if local.exception() is not None or stats is None or stats.skipped:
            item.completion.adopt(local)
            item.completion.complete(self._callbacks)
            discard_local(item.local_path)
            return
        t = time.perf_counter()
        error: UploadError | None = None
        try:
            self.transfer(item.url, item.fs, item.rpath, item.local_path)
        except UploadError as exc:
            error = exc
        upload_s = time.perf_counter() - t
        if error is None:
            with self._cond:
                self.uploaded_bytes += stats.file_bytes
                self.upload_s += upload_s
            self.finish_local(item.url, item.rpath, item.local_path)
            now = time.perf_counter() - item.t0
            stats = replace(
                stats, path=item.url, durable_s=now, local_s=stats.durable_s, upload_s=upload_s,
                upload_gbps=stats.file_bytes / upload_s / 1e9 if upload_s > 0 else 0.0,
            )  # fmt: skip
            logger.debug("lazyckpt: uploaded %s (%d bytes) in %.3f s", item.url, stats.file_bytes, upload_s)
        else:
            error.local_path = item.local_path  # kept: nothing is lost, the caller may upload it again
        # published before the handle is done: whoever sees it done finds the error
        item.completion.finish(None if error else stats, error, self._publish, self._callbacks)

    def finish_local(self, url: str, rpath: str, local_path: str) -> None:
        """After an upload: move the local copy to ``<local_dir>/<protocol>/<key>`` (``keep_local``), else delete it."""
        if not self.options.keep_local:
            discard_local(local_path)
            return
        proto = url.split("://", 1)[0]
        mirror = os.path.join(self.local_dir, proto, rpath.lstrip("/"))
        try:
            os.makedirs(os.path.dirname(mirror), exist_ok=True)
            os.replace(local_path, mirror)
        except OSError as exc:
            logger.warning("lazyckpt: could not keep the local copy of %s at %s: %s", url, mirror, exc)
        discard_local(local_path)

    def transfer(self, url: str, fs: Any, rpath: str, local_path: str) -> None:
        """Upload ``local_path`` to ``url`` on the calling thread (``storage/objects.py``); raises
        ``UploadError`` (other errors are wrapped)."""
        try:
            if is_s3(fs):
                S3Upload(fs, rpath, url, local_path, self.options, self._parts).run(self._started_at)
            else:
                generic_upload(fs, rpath, url, local_path, self.options)
        except UploadError:
            raise
        except Exception as exc:  # a bug or a permanent error: typed anyway
            raise UploadError(f"upload of {url} failed: {exc}", url) from exc
        finally:  # fsspec instances are shared: drop their cached listings
            invalidate(fs, rpath)

    def delete_object(self, url: str, fs: Any, rpath: str) -> None:
        """Delete ``url`` (``remove_prefix``) on the calling thread, retried; ``UploadError`` on failure."""
        retry(f"delete of {url}", lambda: remove_prefix(fs, rpath), url, self.options)


def remove_prefix(fs: Any, rpath: str) -> None:
    """Delete the object or every object under the prefix ``rpath``, if any. The ``.metadata`` or
    ``.lazyckpt-complete`` key goes first, so the prefix stops being a checkpoint before its data does."""
    invalidate(fs, rpath)  # a listing cached before an upload must not hide it
    if fs.isdir(rpath):
        for name in (".metadata", ".lazyckpt-complete"):
            marker = f"{rpath.rstrip('/')}/{name}"
            if fs.exists(marker):
                fs.rm(marker)
    if fs.exists(rpath):
        fs.rm(rpath, recursive=True)
    invalidate(fs, rpath)


def invalidate(fs: Any, rpath: str) -> None:
    with contextlib.suppress(Exception):
        fs.invalidate_cache(rpath)


def discard_local(local_path: str) -> None:
    """Delete a local copy, and its folder if it had one of its own (not the shared files folder)."""
    with contextlib.suppress(OSError):
        os.unlink(local_path)
    if not os.path.dirname(local_path).endswith(_FILES):
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(local_path))


def _remove_dead_leftovers(uploads: str) -> None:
    """Folders of URL saves whose process died (``<pid>-<n>``): their upload never finishes."""
    for name in os.listdir(uploads):
        pid = name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(os.path.join(uploads, name), ignore_errors=True)
        except OSError:
            pass
