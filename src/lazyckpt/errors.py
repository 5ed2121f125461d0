"""Typed errors raised by lazyckpt.

Every error a background thread meets reaches the caller as one of these, with the original
exception chained as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "LazyCkptError",
    "SaveRefusedError",
    "UnsupportedTrainerError",
    "BackpressureWarning",
    "IncompleteCheckpointWarning",
    "InspectError",
    "WriteError",
    "StaleTensorError",
    "CheckpointerClosedError",
    "VerificationError",
    "IncompleteCheckpointError",
    "DistributedSaveError",
    "UploadError",
    "DistributedUploadError",
    "LevelError",
    "DistributedLevelError",
    "MemoryLevelWarning",
    "ReplicationError",
    "ReplicationWarning",
]


class LazyCkptError(Exception):
    """Base class of every error lazyckpt raises on purpose."""


class SaveRefusedError(LazyCkptError, ValueError):
    """``save()`` refused its input before anything was written (nothing is left on disk)."""


class UnsupportedTrainerError(SaveRefusedError):
    """``lazyckpt.transformers.install()`` refused: this Trainer (its class, setup or transformers
    version) does not save the way the integration takes over. Nothing was changed on the trainer."""


class WriteError(LazyCkptError):
    """Writing or committing a checkpoint failed; the previous file at that path is untouched.

    ``path`` is the final path that was not written; ``errno`` is the OS error number when the
    cause was an ``OSError`` (``ENOSPC``, ``EIO``, ``EACCES`` ...), else ``None``.
    """

    def __init__(self, message: str, path: str | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


class StaleTensorError(LazyCkptError):
    """A tensor was changed in place before its copy was safe, so the save was abandoned.

    Raised from ``wait()`` rather than writing a checkpoint that mixes two training states.
    ``tensor_name`` names the offending tensor inside the saved object.
    """

    def __init__(self, message: str, path: str | None = None, tensor_name: str | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.tensor_name = tensor_name


class CheckpointerClosedError(LazyCkptError, RuntimeError):
    """The checkpointer was closed; create a new one."""


class InspectError(LazyCkptError):
    """``lazyckpt inspect`` cannot show a path; the CLI prints the message and exits with status 1."""


class BackpressureWarning(UserWarning):
    """Saves arrive faster than storage drains them."""


class IncompleteCheckpointWarning(UserWarning):
    """A checkpoint was passed over because it is incomplete or fails verification: ``latest()``
    skipping a torn, corrupt or half-uploaded copy (the message names it), ``load_state()`` with
    automatic naming skipping the newest folder."""


class VerificationError(LazyCkptError):
    """A checkpoint file failed verification (bad CRC, truncated, malformed)."""


class IncompleteCheckpointError(LazyCkptError, RuntimeError):
    """A checkpoint folder's save never became durable (crash, or a failed write): its pending marker stays."""


class DistributedSaveError(WriteError):
    """A distributed save (``lazyckpt.distributed``) failed. Nothing was committed at ``path`` (the
    message says so), except when this rank lost the coordination itself (the store's host died, or
    the coordinator decided to commit and never confirmed): then ``path`` holds the complete new
    checkpoint or the old state.

    ``ranks`` are the ranks whose part failed or that did not report in time. On a rank whose own
    part failed, ``__cause__`` is that rank's own error (``WriteError``, ``StaleTensorError`` ...).
    """

    def __init__(
        self, message: str, path: str | None = None, errno: int | None = None, ranks: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message, path=path, errno=errno)
        self.ranks = ranks


class UploadError(WriteError):
    """Uploading a checkpoint to its URL failed (``LazyCheckpointer.save(obj, "s3://...")``): the
    retries ran out on transient errors (HTTP 5xx, throttling, connection resets) or the store
    refused for good (credentials, missing bucket). Nothing was made visible at ``url``: the
    object there (if any) is the previous one, and the multipart upload was aborted.

    ``url`` is the URL that was not written (``path`` too); ``attempts`` how many times the last
    failing request was tried; ``local_path`` the local copy, kept after the failure (until
    ``close()`` when ``local_dir`` is the default temporary directory).
    """

    def __init__(
        self, message: str, url: str, attempts: int = 0, local_path: str | None = None, errno: int | None = None
    ) -> None:
        super().__init__(message, path=url, errno=errno)
        self.url = url
        self.attempts = attempts
        self.local_path = local_path


class DistributedUploadError(DistributedSaveError, UploadError):
    """A distributed save to a URL (``DistributedCheckpointer.save(state, "s3://...")``) failed
    because a rank's upload failed (or the coordinator's upload of ``.metadata``). Raised on every
    rank; ``ranks`` names the ranks whose upload failed. Nothing was made visible at ``url``: no
    ``.metadata`` object was written, and the data objects uploaded were deleted (best effort).

    On a rank whose own upload failed, ``__cause__`` is its ``UploadError`` and ``local_path`` its
    local folder (kept); elsewhere ``local_path`` is None.
    """

    def __init__(
        self,
        message: str,
        url: str,
        ranks: tuple[int, ...] = (),
        attempts: int = 0,
        local_path: str | None = None,
        errno: int | None = None,
    ) -> None:
        WriteError.__init__(self, message, path=url, errno=errno)
        self.url = url
        self.ranks = ranks
        self.attempts = attempts
        self.local_path = local_path


class LevelError(WriteError):
    """A level's copy of a checkpoint failed (the faster levels' copies are unaffected).

    ``level`` is the index of the level in the checkpointer's ``levels``, ``level_path`` its folder
    or URL, ``step`` the step, ``path`` the file (or object) that was not written, ``errno`` the OS
    error number when the cause was an ``OSError``. The cause is chained."""

    def __init__(
        self, message: str, level: int, level_path: str, step: int, path: str, errno: int | None = None
    ) -> None:
        super().__init__(message, path=path, errno=errno)
        self.level = level
        self.level_path = level_path
        self.step = step


class DistributedLevelError(LevelError, DistributedSaveError):
    """A level of a distributed multi-level save (``DistributedCheckpointer(levels=...)``) failed for
    one step: raised alike on every rank (a ``LevelError`` naming the ``level``, ``level_path`` and
    ``step``, and a ``DistributedSaveError`` naming the ``ranks`` whose part failed). Nothing was
    committed at that level for that step (``path``); the other levels are unaffected, except that
    when the fastest due level fails, the slower ones get no copy of that step either. On a rank
    whose own part failed, ``__cause__`` is its own error (an ``OSError`` with ``errno``, an
    ``UploadError`` ...)."""

    def __init__(
        self,
        message: str,
        level: int,
        level_path: str,
        step: int,
        path: str,
        errno: int | None = None,
        ranks: tuple[int, ...] = (),
    ) -> None:
        LevelError.__init__(self, message, level, level_path, step, path, errno=errno)
        self.ranks = ranks


class MemoryLevelWarning(UserWarning):
    """A memory level (tmpfs) would hold more than the stated fraction of RAM."""


class ReplicationError(LevelError):
    """A step of a level with ``replicas=k`` could not be held in a peer's memory (the partner node
    is gone or its pair timed out, the partner could not store it: ``errno`` ENOSPC, or the bytes
    it received did not match the primary's CRC32). The local copy stands: the step is recorded as
    not replicated (``DistributedCheckpointer.not_replicated``) and one ``ReplicationWarning`` says
    so; saves and training go on. ``partner`` is the rank the files were sent to."""

    def __init__(
        self, message: str, level: int, level_path: str, step: int, path: str, errno: int | None = None,
        partner: int | None = None,
    ) -> None:  # fmt: skip
        LevelError.__init__(self, message, level, level_path, step, path, errno=errno)
        self.partner = partner


class ReplicationWarning(UserWarning):
    """Steps of a replicated level were not replicated (see ``ReplicationError``), or a replica was
    skipped at restore (torn, corrupt: its CRC32 does not match the primary's)."""
