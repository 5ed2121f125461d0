from __future__ import annotations

import threading

import pytest
import torch

SLOW_S = 20.0  # a test past this many seconds (setup + call + teardown) carries @pytest.mark.slow(reason=...)
_durations: dict[str, float] = {}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    soak = "soak" in (config.option.markexpr or "")
    gpu = torch.cuda.is_available()
    unexplained = [i.nodeid for i in items for m in i.iter_markers("slow") if not m.kwargs.get("reason")]
    if unexplained:
        raise pytest.UsageError(f"@pytest.mark.slow needs reason='...' (why it takes its time): {unexplained}")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs CUDA"))
        if "soak" in item.keywords and not soak:
            item.add_marker(pytest.mark.skip(reason="opt-in soak: run with -m soak"))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "slow" not in report.keywords:  # keywords travel with the report from xdist workers
        _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """DeepSpeed's CPU all-reduce buffers in /dev/shm that ended ranks left (docs examples, Trainer runs)."""
    from _launch import release_shm

    release_shm()


def pytest_terminal_summary(terminalreporter, exitstatus, config: pytest.Config) -> None:
    """Name the tests that took longer than SLOW_S without the slow marker (xdist workers' reports
    reach the controller's hook too)."""
    over = sorted((s, n) for n, s in _durations.items() if s > SLOW_S)
    if over:
        terminalreporter.write_sep("-", f"slower than {SLOW_S:.0f} s without @pytest.mark.slow")
        for s, n in reversed(over):
            terminalreporter.write_line(f"{s:7.1f} s  {n}")


@pytest.fixture
def ckpt():
    from lazyckpt import LazyCheckpointer

    c = LazyCheckpointer(host_memory_budget=256 << 20, chunk_bytes=4 << 20)
    yield c
    if not c.closed:
        c.close()


@pytest.fixture(autouse=True)
def _torch_threads_restored():
    """A test that sets torch's thread count (the benchmarks' smoke tests, the regime tests) must not
    change the next tests' regime: lazyckpt writes a memory file inside save() or in the background
    depending on whether a core is spare."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(autouse=True)
def _small_disk_files_in_the_background(monkeypatch):
    """The tests in this process exercise the background path for disk files of any size (with
    tensor data or not), as with a
    core to spare (GPU training): on this 2-core machine torch's default threads make every test the
    busy regime, where ``save()`` writes a small disk file itself (``core/plan.write_in_save``) and
    most lazy-path tests would test nothing. The busy regime's own tests (``test_busy_regime.py``)
    set the product's bound back (``busy_rule``); memory filesystems keep the product's rule, and
    processes the tests start (``tests/*_scripts``) run the product's rule unchanged."""
    from lazyckpt.core import plan

    monkeypatch.setattr(plan, "INLINE_MAX_BYTES", 0)
    monkeypatch.setattr(plan, "TINY_MAX_BYTES", 0)


@pytest.fixture
def busy_rule(monkeypatch):
    """The product's placement rule for disk files (undoes ``_small_disk_files_in_the_background``)."""
    from lazyckpt.core import plan

    monkeypatch.setattr(plan, "INLINE_MAX_BYTES", 64 << 20)
    monkeypatch.setattr(plan, "TINY_MAX_BYTES", 1 << 20)
    return plan


@pytest.fixture(autouse=True)
def _no_leaked_threads():
    """Every test must close its checkpointers: no lazyckpt thread may outlive it."""
    yield
    leaked = [t.name for t in threading.enumerate() if t.name.startswith("lazyckpt-")]
    if leaked:
        from lazyckpt.core import exit as _exit

        for c in _exit.registered(_exit.CORE):
            try:
                c.close()
            except Exception:
                pass
        pytest.fail(f"lazyckpt threads left running: {sorted(set(leaked))}")


@pytest.fixture(autouse=True)
def _not_left_inside_lazyckpt(request):
    """No lazyckpt lock or wait may leave this thread counted as inside lazyckpt (``threads/reentry.py``):
    every later save would then be written synchronously."""
    from lazyckpt.threads import reentry

    before = (reentry.synchronous_saves, reentry.refused_waits)
    yield
    assert reentry.depth() == 0, f"this thread is left {reentry.depth()} deep inside lazyckpt"
    if "reentry" not in request.keywords:  # lazyckpt calling its own save() / wait() while inside it
        after = (reentry.synchronous_saves, reentry.refused_waits)
        assert after == before, "a save was written synchronously, or a wait refused (re-entered), with no signal"


@pytest.fixture
def mem():
    """A memory level's folder on /dev/shm (tmpfs), removed afterwards."""
    import shutil
    import uuid

    path = f"/dev/shm/lazyckpt-test-{uuid.uuid4().hex[:12]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def s3():
    """(storage_options, s3fs filesystem) of a real S3 API (moto's server on 127.0.0.1) holding the
    bucket ``levels``; one server per test module."""
    import s3fs

    from _s3server import moto_server, s3_options

    with moto_server() as port:
        opts = s3_options(f"http://127.0.0.1:{port}")
        fs = s3fs.S3FileSystem(**opts)
        fs.call_s3("create_bucket", Bucket="levels")
        yield opts, fs
