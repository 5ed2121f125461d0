"""Object-store transfers on the calling thread: S3 uploads (PutObject or parallel multipart, aborted on
failure), other fsspec backends (hidden key, then a move), retries and error classification.
``core/remote.py`` decides what is uploaded when.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from lazyckpt.errors import UploadError
from lazyckpt.options import CheckpointerOptions
from lazyckpt.threads import reentry
from lazyckpt.threads.workers import Worker

logger = logging.getLogger(__name__)

T = TypeVar("T")

_BACKOFF_S = 0.25  # first retry delay; doubles per attempt, at most _BACKOFF_MAX_S
_BACKOFF_MAX_S = 20.0
_PERMANENT = (PermissionError, FileNotFoundError, IsADirectoryError, NotADirectoryError, ValueError, TypeError)


def generic_upload(fs: Any, rpath: str, url: str, local_path: str, options: CheckpointerOptions) -> None:
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


class S3Upload:
    """One file to S3: a single PutObject up to one part, else a multipart upload, parts in parallel."""

    def __init__(
        self, fs: Any, rpath: str, url: str, local_path: str, options: CheckpointerOptions, parts: PartPool
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
        """Abort multipart uploads to this key begun before this checkpointer started (a dead process's)."""
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
    """The HTTP status of a botocore ``ClientError`` in the cause chain (throttling codes as 503)."""
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


class PartPool:
    """Daemon threads that run upload parts (a ``Worker``: usable at interpreter exit, unlike an executor)."""

    def __init__(self, threads: int) -> None:
        self._worker: Worker[Callable[[], None]] = Worker(
            "lazyckpt-upload-part", lambda task: task(), threads=threads, numbered=True
        )

    def map(self, fn: Callable[[Any], T], items: list[Any]) -> list[T]:
        """``[fn(i) for i in items]`` in parallel; after an error, unstarted calls are skipped and the
        first error is raised once every started call has ended."""
        results: list[Any] = [None] * len(items)
        errors: list[BaseException] = []
        left = [len(items)]
        lock = reentry.condition()

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
