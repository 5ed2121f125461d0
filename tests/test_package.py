"""The package users install: the built wheel, installed into a fresh virtual environment, runs the
quickstart of the documentation (docs/index.md's first example) and carries its metadata."""

from __future__ import annotations

import email
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from test_docs import examples

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow(reason="builds the wheel and a fresh virtual environment (pip), then runs the quickstart")
def test_the_built_wheel_installs_into_a_fresh_venv_and_runs_the_quickstart(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(dist), str(ROOT)],
        check=True, cwd=tmp_path,
    )  # fmt: skip
    (wheel,) = dist.glob("lazyckpt-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        meta = email.message_from_bytes(zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert "lazyckpt/py.typed" in names and not any(n.startswith(("tests/", "benchmarks/")) for n in names)
    assert {"lightning", "accelerate", "transformers", "s3"} <= set(meta.get_all("Provides-Extra"))
    assert meta.get_all("Classifier") and meta.get_all("Project-URL")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True)
    # torch and isal come from the test environment's site-packages (a path, not its .pth files: the
    # editable lazyckpt there stays invisible); lazyckpt itself is the wheel's
    purelib = subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], check=True,
        capture_output=True, text=True,
    ).stdout.strip()  # fmt: skip
    Path(purelib, "test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    (_, quickstart), *_ = examples("docs/index.md")
    script = "import lazyckpt, sys\nassert lazyckpt.__file__.startswith(sys.prefix), lazyckpt.__file__\n" + quickstart
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([str(py), "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "['model', 'optim']" in proc.stdout
    cli = subprocess.run([str(venv / "bin" / "lazyckpt"), "verify", str(tmp_path / "run" / "step-3.pt")], env=env)
    assert cli.returncode == 0
