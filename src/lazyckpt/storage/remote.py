"""The remote tier: saves to URLs (``s3://``, any fsspec URL) through a local tier, uploaded in the background.

A URL save is the ordinary local save into the local tier (``local_dir``), then an upload:

    save(obj, url) -> local save into <local_dir>/.uploads/<pid>-<n>/<name>  (handle staged, local)
                   -> lazyckpt-upload (one thread, FIFO in save order): waits for that local commit,
                      uploads it (S3: multipart, parts in parallel on lazyckpt-upload-part-N), then
                      the remote handle is done; keep_local moves the file to <local_dir>/<proto>/<key>.

What appears at the URL: S3 (s3fs): a file of up to one part is one ``PutObject``; larger files are a
multipart upload, which S3 makes visible only when ``CompleteMultipartUpload`` succeeds; on failure
the upload is aborted (``AbortMultipartUpload``). Other fsspec backends: the file is ``put`` to a
hidden temporary key next to the final one (``.<name>.lazyckpt-upload-<token>.tmp``) and moved;
the move is atomic where the backend's is (a rename for ``file://``, one dict update for
``memory://``; a server-side copy for object stores other than S3).

One thread moves files, in save order, so two saves to one URL land in order and a ``remove(url)``
queued behind a save runs after its upload. Retries with exponential backoff (and jitter) on
transient errors: HTTP 5xx, 408, 429 / SlowDown, connection resets and timeouts; ``UploadError``
once ``upload_retries`` are spent or on a permanent error (credentials, missing bucket). Nothing
here logs ``storage_options`` (credentials live there); messages name URLs only.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import random
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

from lazyckpt.core.handle import CallbackRunner, Completion, Outcome, SaveHandle, SaveStats
from lazyckpt.core.removal import RemovalFuture
from lazyckpt.core.report import Report
from lazyckpt.core.workers import Worker
from lazyckpt.errors import SaveRefusedError, UploadError
from lazyckpt.options import CheckpointerOptions

logger = logging.getLogger(__name__)

T = TypeVar("T")

_BACKOFF_S = 0.25  # first retry delay; doubles per attempt, at most _BACKOFF_MAX_S (tests lower it)
_BACKOFF_MAX_S = 20.0
_PERMANENT = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)
_UPLOADS = ".uploads"  # inside local_dir: one folder per pending folder save, one for this process's files
_FILES = "-files"  # <local_dir>/.uploads/<pid>-files: the local copies of single-file URL saves
WARN_AFTER_S = 0.5  # a URL save that waited longer than this for uploads warns (tests lower it)


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
    """The handle of a URL save: staged (host copies done), local (the local copy is committed),
    done (the object is complete in the store). Staging and confirmation are the local save's."""

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
        return self.wait_finished(None if deadline is None else max(0.0, deadline - time.monotonic()))


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
    # The local path's future type: an error fetched through it is claimed, so wait() does not raise it again.
    future: RemovalFuture = field(default_factory=RemovalFuture)


class RemoteTier:
    """Owns the local tier's folder, the upload threads, and the URL saves not yet in the store.

    Thread safety: ``register``/``remove``/``admit``/``wait``/``pending_urls`` from any thread;
    the upload thread only touches its items and ``_lock``'d counters.
    """

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
        # Made once: a folder per save would be a create on the training thread each time, and on
        # ext4 that waits on the journal while the previous checkpoint is fsynced (0.1-0.4 s).
        self._files_dir = os.path.join(self.local_dir, _UPLOADS, f"{os.getpid()}{_FILES}")
        os.makedirs(self._files_dir, exist_ok=True)
        free = shutil.disk_usage(self.local_dir).free
        self.backlog_bound = int(options.upload_backlog_bytes or max(free // 2, 1 << 30))
        self._started_at = time.time()
        self._cond = threading.Condition()
        self._pending: list[_Upload | _Deletion] = []  # in queue order
        self._backlog = 0  # local bytes not yet in the store
        self.wait_s = 0.0  # save() waited for uploads since the last warning
        self.uploaded_bytes = 0
        self.upload_s = 0.0
        self._counter = itertools.count()
        self._filesystems: dict[str, Any] = {}
        self._parts = _PartPool(options.upload_threads)
        self._uploads: Worker[_Upload | _Deletion] = Worker("lazyckpt-upload", self._run_item)

    # -- caller side ------------------------------------------------------------------------------

    def resolve(self, url: str) -> tuple[Any, str]:
        """(filesystem, path) for ``url``: one fsspec instance per protocol, reused (``url_to_fs``
        costs ~10 ms per call for s3, on the training thread). Chained (``a::b``) and query URLs
        go through ``url_to_fs`` each time."""
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
        return fs, fs._strip_protocol(url)

    def local_file(self, rpath: str) -> str:
        """A fresh local path for one single-file save, in this process's files folder (nothing is
        created here: the engine creates the file off the caller's thread)."""
        name = os.path.basename(rpath.rstrip("/")) or "checkpoint"
        return os.path.join(self._files_dir, f"{next(self._counter):06d}-{name}")

    def local_path(self, rpath: str) -> str:
        """A fresh local path, in a folder of its own, for one folder save (its parent is new)."""
        folder = os.path.join(self.local_dir, _UPLOADS, f"{os.getpid()}-{next(self._counter):06d}")
        os.makedirs(folder)
        return os.path.join(folder, os.path.basename(rpath.rstrip("/")) or "checkpoint")

    def admit(self, skip: bool) -> bool:
        """Before a URL save: wait while the local bytes not yet uploaded reach the bound (False
        instead of waiting when ``skip``). So local disk holds at most the bound plus one save."""
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
        local.wait_finished()  # committed by the local engine; confirmed by the training's thread, never here
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
        """After ``url`` was uploaded from ``local_path``: keep the local copy at
        ``<local_dir>/<protocol>/<key>`` (``keep_local``), else delete it."""
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
        """Upload ``local_path`` to ``url`` on the calling thread (S3: one PutObject or a multipart
        upload whose parts run on the tier's part threads, aborted on failure; other backends: a
        hidden temporary key, then a move). Raises ``UploadError`` (any other error is wrapped)."""
        try:
            if is_s3(fs):
                _S3Upload(fs, rpath, url, local_path, self.options, self._parts).run(self._started_at)
            else:
                _generic_upload(fs, rpath, url, local_path, self.options)
        except UploadError:
            raise
        except Exception as exc:  # a bug or a permanent error: typed anyway
            raise UploadError(f"upload of {url} failed: {exc}", url) from exc
        finally:  # fsspec instances are shared (Lightning's ModelCheckpoint lists through the same one)
            invalidate(fs, rpath)

    def delete_object(self, url: str, fs: Any, rpath: str) -> None:
        """Delete ``url`` on the calling thread if it exists (retried; a prefix as a whole, see
        ``remove_prefix``); ``UploadError`` on failure."""
        retry(f"delete of {url}", lambda: remove_prefix(fs, rpath), url, self.options)


def remove_prefix(fs: Any, rpath: str) -> None:
    """Delete the object or every object under the prefix ``rpath``, if any. A distributed
    checkpoint's prefix loses its ``.metadata`` first (a folder checkpoint its ``.lazyckpt-complete``
    manifest, ``_remote_folder``), so that it stops being a checkpoint before its data objects go
    (there is no atomic delete of many objects)."""
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


def before_interpreter_shutdown(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the interpreter starts shutting down, before ``concurrent.futures`` refuses
    new work. ``atexit`` is too late for uploads: aiohttp (under s3fs) resolves host names through
    the loop's default executor, which then raises "cannot schedule new futures after interpreter
    shutdown". Hooks registered through ``threading._register_atexit`` run in reverse order, so one
    registered after ``concurrent.futures`` was imported runs before its shutdown flag is set."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - CPython >= 3.9 has it
        return
    try:
        register(fn)
    except RuntimeError:  # already shutting down: atexit's drain is what is left
        logger.debug("lazyckpt: interpreter shutting down; uploads drain at exit only")


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


# -- transfers -------------------------------------------------------------------------------------


def _generic_upload(fs: Any, rpath: str, url: str, local_path: str, options: CheckpointerOptions) -> None:
    """Any fsspec backend: put to a hidden temporary key beside the final one, then move."""
    parent, name = rpath.rstrip("/").rsplit("/", 1) if "/" in rpath.rstrip("/") else ("", rpath)
    tmp = f"{parent}/.{name}.lazyckpt-upload-{os.getpid()}-{random.getrandbits(32):08x}.tmp"
    try:
        if parent:
            retry(f"makedirs for {url}", lambda: fs.makedirs(parent, exist_ok=True), url, options)
        retry(f"upload of {url}", lambda: fs.put_file(local_path, tmp), url, options)
        retry(f"move into {url}", lambda: fs.mv(tmp, rpath), url, options)
    except BaseException:
        with contextlib.suppress(Exception):
            fs.rm(tmp)
        raise


class _S3Upload:
    """One file to S3: a single PutObject up to one part, else a multipart upload, parts in parallel."""

    def __init__(
        self, fs: Any, rpath: str, url: str, local_path: str, options: CheckpointerOptions, parts: _PartPool
    ) -> None:
        self.fs, self.url, self.local_path, self.options, self.parts = fs, url, local_path, options, parts
        self.bucket, self.key, _ = fs.split_path(rpath)

    def call(self, what: str, method: str, **kwargs: Any) -> Any:
        return retry(what, lambda: self.fs.call_s3(method, **kwargs), self.url, self.options)

    def run(self, tier_started: float) -> None:
        fd = os.open(self.local_path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            part = self.options.upload_part_bytes
            if size <= part:
                body = _pread(fd, size, 0)
                self.call(f"upload of {self.url}", "put_object", Bucket=self.bucket, Key=self.key, Body=body)
                return
            self._abort_stale(tier_started)
            upload = self.call(f"start of {self.url}", "create_multipart_upload", Bucket=self.bucket, Key=self.key)
            upload_id = upload["UploadId"]
            try:
                ranges = [(n + 1, off, min(part, size - off)) for n, off in enumerate(range(0, size, part))]
                etags = self.parts.map(lambda r: self._part(fd, upload_id, *r), ranges)
                done = {"Parts": [{"PartNumber": n, "ETag": e} for (n, _, _), e in zip(ranges, etags, strict=True)]}
                self.call(
                    f"completion of {self.url}", "complete_multipart_upload",
                    Bucket=self.bucket, Key=self.key, UploadId=upload_id, MultipartUpload=done,
                )  # fmt: skip
            except BaseException:
                self._abort(upload_id)
                raise
        finally:
            os.close(fd)

    def _part(self, fd: int, upload_id: str, number: int, offset: int, nbytes: int) -> str:
        def send() -> str:
            body = _pread(fd, nbytes, offset)  # read again per attempt: nothing kept between tries
            out = self.fs.call_s3(
                "upload_part", Bucket=self.bucket, Key=self.key, UploadId=upload_id, PartNumber=number, Body=body
            )
            return str(out["ETag"])

        return retry(f"part {number} of {self.url}", send, self.url, self.options)

    def _abort(self, upload_id: str) -> None:
        try:
            self.call(f"abort of {self.url}", "abort_multipart_upload", Bucket=self.bucket, Key=self.key,
                      UploadId=upload_id)  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - the upload's own error is the one to report
            logger.warning("lazyckpt: could not abort the multipart upload to %s (%s); a bucket lifecycle "
                           "rule for incomplete multipart uploads removes it", self.url, exc)  # fmt: skip

    def _abort_stale(self, tier_started: float) -> None:
        """Multipart uploads to this key begun before this checkpointer started (a killed process's)."""
        try:
            listed = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket, Prefix=self.key)
            for up in listed.get("Uploads", []):
                initiated = up.get("Initiated")
                if up.get("Key") == self.key and initiated is not None and initiated.timestamp() < tier_started:
                    self.fs.call_s3("abort_multipart_upload", Bucket=self.bucket, Key=self.key, UploadId=up["UploadId"])
                    logger.info("lazyckpt: aborted an unfinished multipart upload to %s from %s", self.url, initiated)
        except Exception as exc:  # noqa: BLE001 - housekeeping only
            logger.debug("lazyckpt: listing unfinished uploads to %s failed: %s", self.url, exc)


def _pread(fd: int, nbytes: int, offset: int) -> bytes:
    chunks = []
    while nbytes:
        data = os.pread(fd, nbytes, offset)
        if not data:
            raise OSError(f"local copy shorter than expected at byte {offset}")
        chunks.append(data)
        nbytes -= len(data)
        offset += len(data)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


# -- retries ---------------------------------------------------------------------------------------


def _http_status(exc: BaseException) -> int | None:
    """The HTTP status in a botocore ``ClientError`` anywhere in the cause chain (s3fs translates)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return None
        response = getattr(seen, "response", None)
        if isinstance(response, dict):
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            code = str(response.get("Error", {}).get("Code", ""))
            if code in ("SlowDown", "Throttling", "ThrottlingException", "RequestTimeout"):
                return 503
            if isinstance(status, int):
                return status
        seen = seen.__cause__ or seen.__context__
    return None


def transient(exc: BaseException) -> bool:
    """Worth retrying: 5xx, 408, 429, throttling codes, and errors without a status (resets, timeouts)."""
    if isinstance(exc, UploadError):
        return False
    status = _http_status(exc)
    if status is not None:
        return status >= 500 or status in (408, 429)
    return not isinstance(exc, _PERMANENT)


def retry(what: str, fn: Callable[[], T], url: str, options: CheckpointerOptions) -> T:
    attempts = options.upload_retries + 1
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except Exception as exc:
            if not transient(exc) or attempt == attempts:
                kind = "failed" if not transient(exc) else f"failed after {attempt} attempts"
                raise UploadError(
                    f"{what} {kind}: {type(exc).__name__}: {exc}", url, attempts=attempt,
                    errno=getattr(exc, "errno", None),
                ) from exc  # fmt: skip
            delay = min(_BACKOFF_S * 2 ** (attempt - 1), _BACKOFF_MAX_S) * random.uniform(0.5, 1.0)
            logger.info("lazyckpt: %s: %s (attempt %d of %d), retrying in %.2f s", what, exc, attempt, attempts, delay)
            time.sleep(delay)
    raise AssertionError("unreachable")  # pragma: no cover


class _PartPool:
    """Named daemon threads that run parts (a ``Worker``: usable at interpreter exit, unlike an executor)."""

    def __init__(self, threads: int) -> None:
        self._worker: Worker[Callable[[], None]] = Worker(
            "lazyckpt-upload-part", lambda task: task(), threads=threads, numbered=True
        )

    def map(self, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
        """``[fn(i) for i in items]`` in parallel; the first error is raised once every started call
        has ended, and calls not yet started are skipped after an error."""
        results: list[Any] = [None] * len(items)
        errors: list[BaseException] = []
        left = [len(items)]
        lock = threading.Condition()

        def task(index: int, item: Any) -> None:
            try:
                if not errors:
                    results[index] = fn(item)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                errors.append(exc)
            finally:
                with lock:
                    left[0] -= 1
                    lock.notify_all()

        for index, item in enumerate(items):
            if not self._worker.submit(lambda index=index, item=item: task(index, item)):  # type: ignore[misc]
                task(index, item)  # stopped (interpreter exit): run it here
        with lock:
            while left[0]:
                lock.wait()
        if errors:
            raise errors[0]
        return results

    def stop(self) -> None:
        self._worker.stop()
