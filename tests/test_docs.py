"""The documentation: every code example runs, every public name is in the API reference, and the
README stays a page a new user reads in five minutes."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


SKIP = "<!-- docs-test: skip ("


def examples(page: str) -> list[tuple[int, str]]:
    """(line, code) of each ```python block of ``page``, in order; a block right after a line
    ``<!-- docs-test: skip (why) -->`` is left out (a pattern a multi-node test runs instead)."""
    text = (ROOT / page).read_text()
    found = []
    for m in FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        if not before.startswith(SKIP):
            found.append((text[: m.start()].count("\n") + 1, m.group(1)))
    return found


PAGES_WITH_CODE = [p for p in PAGES if examples(p)]


@pytest.mark.integration
@pytest.mark.parametrize("page", PAGES_WITH_CODE)
def test_every_code_example_of_the_page_runs(page: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "docs_scripts" / "run_page.py"), page, str(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0 and "--- all examples ran" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-6000:]


PUBLIC = [
    "lazyckpt", "lazyckpt.lightning", "lazyckpt.accelerate", "lazyckpt.transformers", "lazyckpt.distributed",
    "lazyckpt.deepspeed",
]  # fmt: skip


def test_every_public_name_is_in_the_api_reference() -> None:
    api = (ROOT / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^::: ([\w.]+)$", api, re.M))
    missing = []
    for package in PUBLIC:
        try:
            module = importlib.import_module(package)
        except ImportError:  # an integration whose framework is not installed here
            continue
        for name in module.__all__:
            obj = getattr(module, name)
            # a name re-exported from another public package is documented once, where it is defined
            if not any(f"{p}.{name}" in documented for p in PUBLIC if getattr(sys.modules.get(p), name, None) is obj):
                missing.append(f"{package}.{name}")
    assert not missing, f"not in docs/api.md: {missing}"


def test_the_readme_is_short_and_shows_install_and_every_framework_early() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    head = "\n".join(lines[:80])
    for needle in ("pip install lazyckpt", "LazyCheckpointIO()", "lazyckpt.accelerate.install(",
                   "lazyckpt.transformers.install(", "DistributedCheckpointer("):  # fmt: skip
        assert needle in head, needle


def test_no_history_in_the_docs() -> None:
    """No dated run logs, commit hashes or issue numbers in the README or docs/ (history: CHANGELOG.md)."""
    found = []
    history = re.compile(
        r"\b20\d\d-\d\d-\d\d\b|\b[Ii]ssues? #?\d+\b|\b(?:commit|on|at|before|since|after) [0-9a-f]{7,40}\b"
    )
    for page in PAGES:
        for n, line in enumerate((ROOT / page).read_text().splitlines(), 1):
            if history.search(line):
                found.append(f"{page}:{n}: {line.strip()[:100]}")
    assert not found, "\n".join(found)
