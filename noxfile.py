"""Developer sessions. `nox -l` lists them; `nox -s tests` is what CI runs (via scripts/test.sh).

torch is installed first, pinned (LAZYCKPT_TORCH, default torch==2.13.0): a bare `torch`
requirement would pull a multi-GB CUDA build on a CPU machine.
"""

from __future__ import annotations

import os

import nox

nox.options.sessions = ["lint", "typecheck", "tests"]
TORCH = os.environ.get("LAZYCKPT_TORCH", "torch==2.13.0")
PYTHON = "3.11"


def _install(session: nox.Session, *extras: str, pins: tuple[str, ...] = ()) -> None:
    session.install(TORCH)
    spec = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", spec, *pins)


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The whole suite on CPU: core, Lightning, Accelerate, multi-process (gloo). GPU tests skip."""
    _install(session, "test", "lightning", "accelerate", "transformers", "deepspeed")
    session.run("pytest", *session.posargs)


@nox.session(python=PYTHON)
def core(session: nox.Session) -> None:
    """Core tests only, without Lightning or Accelerate installed (the core must not need them)."""
    _install(session, "test")
    skip = ["--ignore-glob=tests/test_lightning*", "--ignore-glob=tests/test_accelerate*"]
    session.run("pytest", *skip, *session.posargs)


# The supported range (README "Supported versions"): the oldest and newest of each framework, and an install
# with only the standalone pytorch_lightning package (no `lightning`).
FRAMEWORK_PINS = {
    "oldest": ("lightning==2.5.6", "accelerate==1.13.0"),
    "newest": ("lightning", "accelerate"),
    "pl_only": ("pytorch_lightning", "accelerate"),
}


@nox.session(python=PYTHON)
@nox.parametrize("pins", list(FRAMEWORK_PINS.values()), ids=list(FRAMEWORK_PINS))
def frameworks(session: nox.Session, pins: tuple[str, ...]) -> None:
    """Integration tests on the oldest and newest supported Lightning and Accelerate, and pytorch_lightning alone."""
    _install(session, "test", pins=pins + ("safetensors",))
    if "pytorch_lightning" in pins:  # tests that need `lightning` skip; the pytorch_lightning-only test runs
        session.run("python", "-c", "import importlib.util as u; assert u.find_spec('lightning') is None")
    session.run("pytest", "-m", "integration", *session.posargs)


# What the upstream test files import that our extras do not install.
UPSTREAM_TEST_DEPS = ("parameterized", "cloudpickle>=1.3,<3.2", "tensorboardX", "jsonargparse[signatures]")


@nox.session(python=PYTHON)
def upstream(session: nox.Session) -> None:
    """Lightning's, Accelerate's (and DeepSpeed's) own checkpoint tests: stock, with lazyckpt injected, and with
    the control. DeepSpeed's: with LAZYCKPT_DEEPSPEED_SRC pointing at its repository's tests/ at the installed tag.

    Accelerate's tests come from the sdist of the installed version (downloaded here). Lightning's sdist has no
    tests: check the repository out at the installed tag and point LAZYCKPT_LIGHTNING_SRC at it (its tests/ is
    used; nothing of it is copied into this repository). Long (~10 min without hangs): not a default session.
    """
    _install(session, "test", "lightning", "accelerate")
    session.install(*UPSTREAM_TEST_DEPS)
    suites = ["accelerate", "lightning", "fabric"] if os.environ.get("LAZYCKPT_LIGHTNING_SRC") else ["accelerate"]
    if suites == ["accelerate"]:
        session.warn("LAZYCKPT_LIGHTNING_SRC unset: Lightning's and Fabric's suites skipped")
    if os.environ.get("LAZYCKPT_DEEPSPEED_SRC"):
        _install(session, "deepspeed")
        suites.append("deepspeed")
    session.run("python", "scripts/upstream/run.py", "--suites", *suites, *session.posargs)


@nox.session(venv_backend="none")
def gpu(session: nox.Session) -> None:
    """GPU tests and the CUDA benchmark, with the machine's own CUDA torch (no venv, no downloads)."""
    env = {"PYTHONPATH": "src"}
    session.run("python", "-m", "pytest", "-m", "gpu", "-rs", "-p", "no:cacheprovider", *session.posargs, env=env)
    session.run("python", "-m", "benchmarks.bench_core", "--device", "cuda", "--size", "1b", "--steps", "6", env=env)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Side-by-side speed: no checkpoint, torch.save+fsync, DCP async_save, lazyckpt (~100M GPT, CPU)."""
    _install(session, "test", "lightning", "accelerate")
    session.run("python", "-m", "benchmarks.bench_core", "--size", "100m", *session.posargs)


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Build the documentation site (warnings are errors); `nox -s docs -- serve` serves it on localhost:8000."""
    _install(session, "docs", "lightning", "accelerate", "transformers")
    session.run("python", "-m", "benchmarks.report", "--check")
    if session.posargs[:1] == ["serve"]:
        session.run("mkdocs", "serve", "--strict")
    else:
        session.run("mkdocs", "build", "--strict", "--site-dir", "build/site")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff lint and format check."""
    session.install("ruff")
    session.run("ruff", "check", "src", "tests", "examples", "benchmarks")
    session.run("ruff", "format", "--check", "src", "tests", "examples", "benchmarks")


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy on src/."""
    _install(session, "lightning", "accelerate")
    session.install("mypy")
    session.run("mypy")
