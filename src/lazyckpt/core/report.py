"""Background errors handed out exactly once.

A failed save or removal, or an error an integration hands over, becomes one ``Report``, claimed by
whoever reaches it first: the owner (``handle.wait()``, ``future.result()``) or the checkpointer's next
``save()`` / ``wait()`` / ``close()`` / ``raise_errors()`` through the ``ErrorLedger``.
"""

from __future__ import annotations

from lazyckpt.threads import reentry

_CLAIM = reentry.Lock()  # claims are rare and tiny: one lock for every report


class Report:
    """One background error; ``claim()`` returns True to exactly one caller."""

    __slots__ = ("error", "_claimed")

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self._claimed = False

    @property
    def claimed(self) -> bool:
        return self._claimed

    def claim(self) -> bool:
        with _CLAIM:
            first, self._claimed = not self._claimed, True
        return first


class ErrorLedger:
    """Reports published by lazyckpt threads, oldest first, until claimed. Publish a report once its error
    is final and BEFORE its save is visibly done: whoever saw it finish must find the error here."""

    def __init__(self) -> None:
        self._lock = reentry.Lock()
        self._reports: list[Report] = []

    def publish(self, report: Report) -> None:
        with self._lock:
            self._reports.append(report)

    def take(self) -> list[BaseException]:
        """The errors nobody has seen yet, oldest first; each is returned once."""
        with self._lock:
            reports, self._reports = self._reports, []
        return [r.error for r in reports if r.claim()]


def raise_first(errors: list[BaseException]) -> None:
    """Raise the oldest error, with a note naming how many more there were."""
    if not errors:
        return
    err = errors[0]
    if len(errors) > 1 and hasattr(err, "add_note"):  # Python >= 3.11
        err.add_note(f"lazyckpt: {len(errors) - 1} more background error(s): " + "; ".join(map(str, errors[1:])))
    raise err
