"""pytest plugin: one JSON line per test (nodeid, outcome, first error line) to $LAZYCKPT_UPSTREAM_RECORD.

Lines are written and flushed as each test starts and ends, so a run that is killed (a hang the per-test
timeout could not break) still leaves every finished outcome and names the test that was running.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

import pytest

_PATH = os.environ.get("LAZYCKPT_UPSTREAM_RECORD")
_reports: dict[str, list[Any]] = {}
TIMEOUT = re.compile(r"Failed: Timeout \(?>[0-9.]+s\)?[^\n]*")  # pytest-timeout's message (signal method)


def _write(row: dict[str, Any]) -> None:
    if _PATH:
        with open(_PATH, "a", encoding="utf-8") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()


def first_error_line(text: str) -> str:
    """The first ``E   `` line of a pytest traceback (the exception), else its last non-empty line."""
    lines = [line for line in text.splitlines() if line.strip()]
    for line in lines:
        if line.startswith("E "):
            return line[1:].strip()[:300]
    return (lines[-1].strip() if lines else "")[:300]


def outcome_of(reports: list[Any]) -> tuple[str, str]:
    """passed | failed | error | hung | skipped | xfailed | xpassed, and the first error line."""
    for rep in reports:
        text = getattr(rep, "longreprtext", "") or ""
        if rep.failed and TIMEOUT.search(text):  # the first E line may be a chained cause: name the timeout
            return "hung", TIMEOUT.search(text).group(0)
    for rep in reports:
        if rep.failed:
            kind = "failed" if rep.when == "call" else "error"
            return kind, first_error_line(rep.longreprtext or "")
    for rep in reports:
        if hasattr(rep, "wasxfail"):
            return ("xpassed" if rep.passed else "xfailed"), ""
        if rep.skipped:
            return "skipped", first_error_line(rep.longreprtext or "")
    return "passed", ""


def pytest_runtest_logstart(nodeid: str, location: Any) -> None:
    _reports[nodeid] = []
    _write({"nodeid": nodeid, "event": "start"})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_logreport(report: Any) -> None:
    _reports.setdefault(report.nodeid, []).append(report)


def pytest_runtest_logfinish(nodeid: str, location: Any) -> None:
    reports = _reports.pop(nodeid, [])
    outcome, message = outcome_of(reports)
    seconds = round(sum(getattr(rep, "duration", 0.0) for rep in reports), 2)
    _write({"nodeid": nodeid, "event": "end", "outcome": outcome, "message": message, "seconds": seconds})
