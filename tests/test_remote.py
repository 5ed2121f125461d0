"""Saves to URLs: the remote tier (``_remote.py``) against ``memory://`` and a real S3 API (moto's
server on 127.0.0.1, started here), with faults injected by an HTTP proxy between s3fs and moto."""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import textwrap
import warnings

import fsspec
import moto.server  # noqa: F401 - the test extra: never skipped (CI installs it through bootstrap)
import pytest
import s3fs
import torch
from fsspec.implementations.memory import MemoryFileSystem

import lazyckpt
from _s3server import FaultProxy, is_part, moto_server, s3_options
from _util import assert_same
from lazyckpt import BackpressureWarning, LazyCheckpointer, UploadError
from lazyckpt.core import remote
from lazyckpt.lightning import LazyCheckpointIO
from lazyckpt.storage import objects as _objects

BUCKET = "ckpts"
PART = 5 << 20


@pytest.fixture(scope="module")
def moto():
    with moto_server() as port:
        yield port


_options = s3_options


@pytest.fixture
def s3(moto, request):
    """(storage_options, s3fs filesystem) on a fresh bucket."""
    opts = _options(f"http://127.0.0.1:{moto}")
    fs = s3fs.S3FileSystem(**opts)
    name = f"{BUCKET}-{request.node.name.lower().replace('_', '-')[:40]}"
    fs.call_s3("create_bucket", Bucket=name)
    yield opts, fs, name
    fs.rm(name, recursive=True)


@pytest.fixture
def proxy(moto):
    p = FaultProxy(moto)
    yield p
    p.close()


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(_objects, "_BACKOFF_S", 0.01)


def _state(nbytes: int = 1 << 20, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(nbytes // 4, generator=g), "step": seed}


def _load(fs, path: str) -> dict:
    return torch.load(io.BytesIO(fs.cat(path)), weights_only=True)


def _ckpt(tmp_path, **kw) -> LazyCheckpointer:
    return LazyCheckpointer(
        fsync=False, host_memory_budget=64 << 20, chunk_bytes=8 << 20, local_dir=str(tmp_path / "tier"), **kw
    )


# -- memory:// ------------------------------------------------------------------------------------


def test_memory_url_round_trip_and_stages(tmp_path):
    fs = fsspec.filesystem("memory")
    state = _state()
    with _ckpt(tmp_path) as ck:
        h = ck.save(state, "memory://t1/run/step-1.pt")
        local = h.wait_local()
        assert h.staged() and h.local()
        stats = h.wait()
        assert h.done() and stats.path == "memory://t1/run/step-1.pt"
        assert stats.file_bytes == local.file_bytes and stats.durable_s >= stats.local_s
        assert ck.pending_paths() == set()
    assert_same(_load(fs, "/t1/run/step-1.pt"), state)
    assert not [p for p in fs.ls("/t1/run", detail=False) if "lazyckpt" in p]  # no temporary key left
    assert not (tmp_path / "tier").exists() or not list((tmp_path / "tier" / ".uploads").glob("*"))


def test_memory_two_saves_to_one_url_land_in_order_then_remove(tmp_path):
    fs = fsspec.filesystem("memory")
    with _ckpt(tmp_path) as ck:
        ck.save(_state(seed=1), "memory://t2/a.pt")
        h2 = ck.save(_state(seed=2), "memory://t2/a.pt")
        removed = ck.remove("memory://t2/a.pt")  # queued behind both uploads
        ck.save(_state(seed=3), "memory://t2/b.pt")
        removed.result(timeout=60)
        h2.wait()
        ck.wait()
    assert not fs.exists("/t2/a.pt")
    assert _load(fs, "/t2/b.pt")["step"] == 3


def test_refused_url_save_leaves_nothing(tmp_path):
    with _ckpt(tmp_path) as ck:
        with pytest.raises(lazyckpt.SaveRefusedError):
            ck.save({"f": lambda: 0}, "memory://t4/x.pt")
        assert not [p for p in (tmp_path / "tier" / ".uploads").rglob("*") if p.is_file()]
        assert ck.pending_paths() == set()
    assert not fsspec.filesystem("memory").exists("/t4/x.pt")


def test_keep_local_mirrors_the_url(tmp_path):
    with _ckpt(tmp_path, keep_local=True) as ck:
        ck.save(_state(seed=4), "memory://t3/run/last.pt").wait()
    kept = tmp_path / "tier" / "memory" / "t3" / "run" / "last.pt"
    assert torch.load(kept, weights_only=True)["step"] == 4


def test_file_url_and_refused_url(tmp_path):
    with _ckpt(tmp_path) as ck:
        ck.save(_state(seed=5), f"file://{tmp_path}/out/x.pt").wait()
        with pytest.raises(lazyckpt.SaveRefusedError, match="no usable filesystem|pip install"):
            ck.save(_state(), "nosuchproto://x/y.pt")
    assert torch.load(tmp_path / "out" / "x.pt", weights_only=True)["step"] == 5


class FlakyMemoryFS(MemoryFileSystem):
    """memory:// whose put_file raises ``errors`` first, in order (fault injection by subclass)."""

    protocol = "flakymem"
    errors: list[BaseException] = []

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("flakymem://"))

    def put_file(self, lpath, rpath, *args, **kwargs):
        if FlakyMemoryFS.errors:
            raise FlakyMemoryFS.errors.pop(0)
        return super().put_file(lpath, rpath, *args, **kwargs)


@pytest.fixture
def flaky(monkeypatch):
    fsspec.register_implementation("flakymem", FlakyMemoryFS, clobber=True)
    monkeypatch.setattr(FlakyMemoryFS, "errors", [])
    return FlakyMemoryFS


def test_generic_backend_retries_then_typed_error_and_nothing_visible(tmp_path, flaky):
    fs = fsspec.filesystem("memory")
    flaky.errors = [ConnectionResetError("reset"), TimeoutError("slow")]
    with _ckpt(tmp_path) as ck:
        ck.save(_state(seed=20), "flakymem://g1/ok.pt").wait()
        assert not flaky.errors  # both transient errors were retried
        flaky.errors = [PermissionError("denied")]
        h = ck.save(_state(seed=21), "flakymem://g1/denied.pt")
        with pytest.raises(UploadError, match="denied") as err:
            h.wait()
        assert err.value.attempts == 1
    assert _load(fs, "/g1/ok.pt")["step"] == 20
    assert sorted(fs.ls("/g1", detail=False)) == ["/g1/ok.pt"]  # no final key, no temporary key


class DenyingRemoveFS(MemoryFileSystem):
    """memory:// whose rm fails for good once ``deny`` is set (a permission error is not retried)."""

    protocol = "denyrm"
    deny = False

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("denyrm://"))

    def rm(self, path, *args, **kwargs):
        if DenyingRemoveFS.deny:
            raise PermissionError(f"injected: may not delete {path}")
        return super().rm(path, *args, **kwargs)


@pytest.fixture
def denying_rm(monkeypatch):
    fsspec.register_implementation("denyrm", DenyingRemoveFS, clobber=True)
    monkeypatch.setattr(DenyingRemoveFS, "deny", False)
    return DenyingRemoveFS


@contextlib.contextmanager
def _failing_removal(tmp_path, denying_rm, url: str, seed: int):
    """A checkpointer that saved ``url`` and then asked to remove it, which fails (injected): yields
    the checkpointer and the removal's future; closing it is part of the body's test."""
    with _ckpt(tmp_path) as ck:
        ck.save(_state(seed=seed), url).wait()
        denying_rm.deny = True
        yield ck, ck.remove(url)


def test_a_failed_url_removal_claimed_by_its_future_is_not_raised_again_by_wait(tmp_path, denying_rm):
    with _failing_removal(tmp_path, denying_rm, "denyrm://d1/a.pt", seed=30) as (ck, fut):
        with pytest.raises(UploadError, match="injected"):
            fut.result(timeout=60)
        ck.wait()  # claimed by its owner: not raised a second time
        assert isinstance(fut.exception(), UploadError)  # the future still holds it
    # close() (the with block) raised nothing either


def test_a_failed_url_removal_not_claimed_by_its_future_is_raised_once_by_wait(tmp_path, denying_rm):
    with _failing_removal(tmp_path, denying_rm, "denyrm://d2/a.pt", seed=31) as (ck, fut):
        with pytest.raises(UploadError, match="injected"):
            ck.wait()
        assert fut.done()
        ck.wait()  # once
        with pytest.raises(UploadError, match="injected"):
            fut.result()  # the owner may still read its own future


def test_transient_classification():
    from botocore.exceptions import ClientError

    def client_error(status: int, code: str = "X") -> ClientError:
        return ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "PutObject")

    assert remote.transient(client_error(500)) and remote.transient(client_error(503))
    assert remote.transient(client_error(400, "SlowDown")) and remote.transient(client_error(429))
    assert not remote.transient(client_error(403)) and not remote.transient(client_error(404))
    wrapped = OSError("translated")
    wrapped.__cause__ = client_error(502)
    assert remote.transient(wrapped)
    assert remote.transient(ConnectionResetError()) and not remote.transient(PermissionError())


# -- S3 (moto server) -----------------------------------------------------------------------------


def test_s3_single_and_multipart_uploads(tmp_path, s3):
    opts, fs, bucket = s3
    small, big = _state(1 << 20, 1), _state(13 << 20, 2)  # one PutObject; 3 parts of 5 MiB
    with _ckpt(tmp_path, storage_options=opts, upload_part_bytes=PART, upload_threads=4) as ck:
        h1 = ck.save(small, f"s3://{bucket}/run/small.pt")
        h2 = ck.save(big, f"s3://{bucket}/run/big.pt")
        assert h2.wait().upload_s > 0
        h1.wait()
    assert_same(_load(fs, f"{bucket}/run/small.pt"), small)
    assert_same(_load(fs, f"{bucket}/run/big.pt"), big)
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


def test_s3_500s_for_a_while_then_success(tmp_path, s3, proxy):
    opts, fs, bucket = s3
    rule = proxy.add("fail", is_part, times=4, status=500)
    state = _state(12 << 20, 3)
    popts = _options(proxy.endpoint)
    with _ckpt(tmp_path, storage_options=popts, upload_part_bytes=PART, upload_threads=2) as ck:
        ck.save(state, f"s3://{bucket}/r/ok.pt").wait()
    assert rule.hits == 4
    assert_same(_load(fs, f"{bucket}/r/ok.pt"), state)
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


def test_s3_connection_cut_mid_part(tmp_path, s3, proxy):
    opts, fs, bucket = s3
    rule = proxy.add("cut", is_part, times=2)
    state = _state(12 << 20, 4)
    with _ckpt(tmp_path, storage_options=_options(proxy.endpoint), upload_part_bytes=PART) as ck:
        ck.save(state, f"s3://{bucket}/r/cut.pt").wait()
    assert rule.hits == 2
    assert_same(_load(fs, f"{bucket}/r/cut.pt"), state)


def test_s3_retries_exhausted_leave_previous_object_and_no_upload(tmp_path, s3, proxy):
    opts, fs, bucket = s3
    url = f"s3://{bucket}/r/model.pt"
    old = _state(1 << 20, 5)
    with _ckpt(tmp_path, storage_options=opts) as ck:
        ck.save(old, url).wait()
    proxy.add("fail", is_part, times=1000, status=503)
    with _ckpt(tmp_path, storage_options=_options(proxy.endpoint), upload_part_bytes=PART, upload_retries=2) as ck:
        h = ck.save(_state(12 << 20, 6), url)
        with pytest.raises(UploadError) as err:
            h.wait()
        assert err.value.url == url and err.value.attempts == 3
        assert err.value.local_path and os.path.exists(err.value.local_path)  # nothing lost
        ck.wait()  # reported once: by handle.wait()
    assert_same(_load(fs, f"{bucket}/r/model.pt"), old)
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


def test_s3_permanent_error_is_typed_and_reported_by_wait(tmp_path, s3):
    opts, _fs, _bucket = s3
    with _ckpt(tmp_path, storage_options=opts) as ck:
        ck.save(_state(), "s3://no-such-bucket-here/x.pt")
        with pytest.raises(UploadError, match="no-such-bucket-here") as err:
            ck.wait()
        assert err.value.attempts == 1


def test_s3_backlog_bound_skips_with_numbers(tmp_path, s3, proxy):
    opts, fs, bucket = s3
    hold = proxy.add("hold", lambda m, p: m == "PUT", times=1)
    with _ckpt(
        tmp_path, storage_options=_options(proxy.endpoint), upload_backlog_bytes=1, on_backpressure="skip"
    ) as ck:
        first = ck.save(_state(seed=7), f"s3://{bucket}/b/1.pt")
        first.wait_local()
        hold.arrived.wait(60)  # the upload is in flight and held: 1 MB waits for upload
        with pytest.warns(BackpressureWarning, match=r"GB on local disk still waiting for upload, bound"):
            skipped = ck.save(_state(seed=8), f"s3://{bucket}/b/2.pt")
        assert skipped.wait().skipped and ck.skipped_saves == 1
        hold.released.set()  # the held request's connection is closed: the upload retries
        first.wait()
    assert _load(fs, f"{bucket}/b/1.pt")["step"] == 7 and not fs.exists(f"{bucket}/b/2.pt")


def test_s3_backlog_bound_blocks_and_warns_with_numbers(tmp_path, s3, proxy, monkeypatch):
    opts, fs, bucket = s3
    monkeypatch.setattr(remote, "WARN_AFTER_S", 0.0)
    hold = proxy.add("hold", lambda m, p: m == "PUT", times=1)
    with _ckpt(tmp_path, storage_options=_options(proxy.endpoint), upload_backlog_bytes=1) as ck:
        first = ck.save(_state(seed=12), f"s3://{bucket}/b/1.pt")
        first.wait_local()
        assert hold.arrived.wait(60)
        tier = ck._producer.remote
        real_wait = tier._cond.wait
        blocked = []

        def wait(timeout=None):  # the second save is blocked on the backlog: let the upload go on
            blocked.append(True)
            hold.released.set()
            return real_wait(timeout)

        monkeypatch.setattr(tier._cond, "wait", wait)
        with pytest.warns(BackpressureWarning, match=r"uploads fall behind: save\(\) waited .* GB of local copies"):
            second = ck.save(_state(seed=13), f"s3://{bucket}/b/2.pt")
        assert blocked and first.done()  # it returned only after the first upload ended
        second.wait()
    assert _load(fs, f"{bucket}/b/2.pt")["step"] == 13


def test_s3_killed_process_mid_upload(tmp_path, s3, proxy):
    """A process killed mid multipart upload: no object at the new key, the old one intact; the
    next checkpointer writing that key aborts the dead upload."""
    opts, fs, bucket = s3
    url = f"s3://{bucket}/k/model.pt"
    old = _state(1 << 20, 9)
    with _ckpt(tmp_path, storage_options=opts) as ck:
        ck.save(old, url).wait()
    held = proxy.add("hold", lambda m, p: is_part(m, p) and "partNumber=2" in p, times=1)
    script = textwrap.dedent(f"""
        import torch, lazyckpt
        ck = lazyckpt.LazyCheckpointer(fsync=False, local_dir={str(tmp_path / "child")!r},
                                       storage_options={_options(proxy.endpoint)!r}, upload_part_bytes={PART})
        ck.save({{"w": torch.ones(3 << 20)}}, {url!r})
        ck.wait()
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.Popen([sys.executable, "-c", script], env=env)
    try:
        assert held.arrived.wait(120), "the child never reached part 2"
        child.kill()
    finally:
        child.wait(60)
    assert_same(_load(fs, f"{bucket}/k/model.pt"), old)
    assert len(fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads", [])) == 1
    held.released.set()
    new = _state(12 << 20, 10)
    with _ckpt(tmp_path, storage_options=opts, upload_part_bytes=PART) as ck:
        ck.save(new, url).wait()
    assert_same(_load(fs, f"{bucket}/k/model.pt"), new)
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


def test_s3_uploads_drain_at_interpreter_exit(tmp_path, s3):
    """A script that saves and exits without wait(): the uploads finish before the interpreter goes
    (atexit alone is too late for s3fs: its HTTP client cannot schedule work any more)."""
    opts, fs, bucket = s3
    script = textwrap.dedent(f"""
        import torch, lazyckpt
        ck = lazyckpt.LazyCheckpointer(fsync=False, local_dir={str(tmp_path / "child")!r},
                                       storage_options={opts!r}, upload_part_bytes={PART})
        ck.save({{"w": torch.ones(3 << 20)}}, "s3://{bucket}/exit/big.pt")
        ck.save({{"w": torch.ones(10)}}, "s3://{bucket}/exit/small.pt")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "failed" not in done.stderr, done.stderr
    assert_same(_load(fs, f"{bucket}/exit/big.pt"), {"w": torch.ones(3 << 20)})
    assert_same(_load(fs, f"{bucket}/exit/small.pt"), {"w": torch.ones(10)})


def test_no_credentials_in_logs(tmp_path, s3, caplog, proxy):
    opts, _fs, bucket = s3
    popts = {**_options(proxy.endpoint), "key": "AKIASECRETKEYID", "secret": "sup3r-s3cret"}
    proxy.add("fail", is_part, times=2)
    caplog.set_level("DEBUG", logger="lazyckpt")
    with _ckpt(tmp_path, storage_options=popts, upload_part_bytes=PART) as ck:
        ck.save(_state(12 << 20, 11), f"s3://{bucket}/c/x.pt").wait()
    text = caplog.text
    assert "retrying" in text and "AKIASECRETKEYID" not in text and "sup3r-s3cret" not in text


def test_warnings_on_lazyckpt_threads_are_errors(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with _ckpt(tmp_path) as ck:
            ck.save(_state(), "memory://t9/x.pt").wait()


# -- Lightning: ModelCheckpoint(dirpath="s3://...") ----------------------------------------------


@pytest.fixture
def s3_env(s3, monkeypatch):
    """Stock Lightning reaches the bucket through fsspec's defaults: the environment."""
    opts, fs, bucket = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["client_kwargs"]["endpoint_url"])
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    s3fs.S3FileSystem.clear_instance_cache()
    yield fs, bucket
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.integration
def test_lightning_s3_dirpath_topk_last_and_resume(tmp_path, s3_env):
    pytest.importorskip("lightning")
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from lightning_scripts.tiny_gpt import RecordingLazyIO, TinyGPT, trainer_kwargs

    fs, bucket = s3_env
    config = dict(every_n_train_steps=1, save_top_k=2, monitor="step", mode="max", save_last=True)

    def fit(io, dirpath, **kw):
        L.seed_everything(0, verbose=False)
        ckpt_path = kw.pop("ckpt_path", None)
        plugins = [io] if io is not None else []
        trainer = L.Trainer(default_root_dir=tmp_path, plugins=plugins, callbacks=[ModelCheckpoint(dirpath=dirpath,
                            **config)], **trainer_kwargs(**kw))  # fmt: skip
        trainer.fit(TinyGPT(), ckpt_path=ckpt_path)
        return trainer

    fit(None, f"s3://{bucket}/stock", max_epochs=1)
    io = RecordingLazyIO()
    fit(io, f"s3://{bucket}/lazy", max_epochs=1)
    names = lambda d: sorted(os.path.basename(p) for p in fs.ls(d, detail=False, refresh=True))  # noqa: E731
    assert names(f"{bucket}/lazy") == names(f"{bucket}/stock") and len(names(f"{bucket}/lazy")) == 3
    last = f"s3://{bucket}/lazy/last.ckpt"
    assert_same(io.expected[last][-1], _load(fs, f"{bucket}/lazy/last.ckpt"))
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")
    # Resume from the bucket, by stock Lightning, with and without the plugin.
    resumed = fit(None, f"s3://{bucket}/resumed-stock", max_epochs=2, ckpt_path=last)
    assert resumed.global_step == 2 * io.expected[last][-1]["global_step"]
    resumed = fit(LazyCheckpointIO(), f"s3://{bucket}/resumed-lazy", max_epochs=2, ckpt_path=last)
    assert resumed.global_step == 2 * io.expected[last][-1]["global_step"]
    assert "last.ckpt" in names(f"{bucket}/resumed-lazy")


# -- verify ----------------------------------------------------------------------------------------


def test_verify_s3_objects_streaming(tmp_path, s3_env, capsys):
    from lazyckpt.cli import main

    fs, bucket = s3_env
    with _ckpt(tmp_path, upload_part_bytes=PART) as ck:
        ck.save(_state(12 << 20, 12), f"s3://{bucket}/v/big.pt")
        ck.save({"w": torch.ones(1000)}, f"s3://{bucket}/v/w.safetensors", format="safetensors")
    assert lazyckpt.verify(f"s3://{bucket}/v/big.pt").ok
    assert lazyckpt.verify(f"s3://{bucket}/v/w.safetensors").ok
    assert main(["verify", f"s3://{bucket}/v/"]) == 0
    assert "2 of 2 OK" in capsys.readouterr().out
    data = bytearray(fs.cat(f"{bucket}/v/big.pt"))
    data[len(data) // 2] ^= 0xFF  # a flipped byte inside the tensor data
    fs.pipe(f"{bucket}/v/bad.pt", bytes(data))
    report = lazyckpt.verify(f"s3://{bucket}/v/bad.pt")
    assert not report.ok and "CRC32 mismatch" in report.problems[0]
    assert main(["verify", "-q", f"s3://{bucket}/v/bad.pt", f"s3://{bucket}/v/missing.pt"]) == 1
    out = capsys.readouterr().out
    assert "CRC32 mismatch" in out and "no such object" in out
