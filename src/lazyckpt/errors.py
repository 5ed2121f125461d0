"""Typed errors raised by lazyckpt; a background thread's error reaches the caller as one of these,
with the original exception as ``__cause__``."""

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
    """``lazyckpt.transformers.install()`` refused this Trainer; nothing was changed on it."""


class WriteError(LazyCkptError):
    """Writing or committing a checkpoint failed; the previous file at that path is untouched.

    ``path`` is the final path not written; ``errno`` the ``OSError`` cause's number, else ``None``.
    """

    def __init__(self, message: str, path: str | None = None, errno: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.errno = errno


class StaleTensorError(LazyCkptError):
    """A tensor was changed in place before its copy was safe, so the save was abandoned.
    ``tensor_name`` names the offending tensor inside the saved object."""

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
    """A checkpoint was passed over because it is incomplete or fails verification (the message
    names it)."""


class VerificationError(LazyCkptError):
    """A checkpoint file failed verification (bad CRC, truncated, malformed)."""


class IncompleteCheckpointError(LazyCkptError, RuntimeError):
    """A checkpoint folder's save never became durable (crash, or a failed write): its pending marker stays."""


class DistributedSaveError(WriteError):
    """A distributed save failed. Nothing was committed at ``path``, unless this rank lost the
    coordination itself: then ``path`` holds the new checkpoint or the old state (the message says).
    ``ranks``: the ranks whose part failed or did not report in time. On a rank whose own part
    failed, ``__cause__`` is its own error."""

    def __init__(
        self, message: str, path: str | None = None, errno: int | None = None, ranks: tuple[int, ...] = ()
    ) -> None:
        super().__init__(message, path=path, errno=errno)
        self.ranks = ranks


class UploadError(WriteError):
    """Uploading a checkpoint to its URL failed (retries spent, or a permanent error); the object at
    ``url`` (also ``path``), if any, is the previous one. ``attempts``: tries of the last failing
    request; ``local_path``: the local copy, kept (until ``close()`` with the default ``local_dir``)."""

    def __init__(
        self, message: str, url: str, attempts: int = 0, local_path: str | None = None, errno: int | None = None
    ) -> None:
        super().__init__(message, path=url, errno=errno)
        self.url = url
        self.attempts = attempts
        self.local_path = local_path


class DistributedUploadError(DistributedSaveError, UploadError):
    """A distributed save to a URL failed because an upload failed; raised on every rank, nothing made
    visible at ``url``. ``ranks``: the ranks whose upload failed; on such a rank ``__cause__`` is its
    ``UploadError`` and ``local_path`` its kept local folder (elsewhere None)."""

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

    ``level`` is the level's index in ``levels``, ``level_path`` its folder or URL, ``step`` the
    step, ``path`` the file or object not written, ``errno`` as for ``WriteError``."""

    def __init__(
        self, message: str, level: int, level_path: str, step: int, path: str, errno: int | None = None
    ) -> None:
        super().__init__(message, path=path, errno=errno)
        self.level = level
        self.level_path = level_path
        self.step = step


class DistributedLevelError(LevelError, DistributedSaveError):
    """A level of a distributed multi-level save failed for one step, raised alike on every rank.

    Nothing was committed at that level for that step; the other levels are unaffected, except that
    when the fastest due level fails, the slower ones get no copy of that step either. On a rank
    whose own part failed, ``__cause__`` is its own error."""

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
    """A step of a level with ``replicas=k`` could not be held in a peer's memory. The local copy
    stands: the step is recorded in ``DistributedCheckpointer.replication.not_replicated`` and a
    ``ReplicationWarning`` is issued. ``partner`` is the rank the files were sent to."""

    def __init__(
        self, message: str, level: int, level_path: str, step: int, path: str, errno: int | None = None,
        partner: int | None = None,
    ) -> None:  # fmt: skip
        LevelError.__init__(self, message, level, level_path, step, path, errno=errno)
        self.partner = partner


class ReplicationWarning(UserWarning):
    """Steps of a replicated level were not replicated, or a corrupt replica was skipped at restore."""


class NotDurableError(OSError):
    """Internal: a checkpoint is at its final name, but making the rename durable (the parent's fsync) failed."""
