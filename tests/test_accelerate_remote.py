"""lazyckpt.accelerate: ``save_state("s3://...")`` / ``load_state("s3://...")`` (one process, CPU).

A folder checkpoint at a URL is its files, uploaded once the local folder is complete, and a
manifest (``.lazyckpt-complete``) uploaded last (``lazyckpt.commit.remote_folder``). Checked against a real
S3 API (moto's server on 127.0.0.1, started here; faults from the proxy in ``_s3server``) and
``memory://``: the same files as a stock ``save_state`` to a local folder, the state at the moment of
the call restored by ``load_state`` from the URL, and nothing loadable when an upload failed.
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("accelerate")
import moto.server as moto_server  # noqa: E402
import s3fs  # noqa: E402
import torch  # noqa: E402
from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from accelerate.utils import ProjectConfiguration  # noqa: E402
from fsspec.implementations.memory import MemoryFileSystem  # noqa: E402

import lazyckpt.accelerate as LA  # noqa: E402
from _launch import run_python  # noqa: E402
from _s3server import FaultProxy  # noqa: E402
from accelerate_scripts import acc_common as C  # noqa: E402
from lazyckpt.commit import remote_folder as _remote_folder  # noqa: E402
from lazyckpt.core import remote as _remote  # noqa: E402
from lazyckpt.errors import IncompleteCheckpointError, SaveRefusedError, UploadError  # noqa: E402
from lazyckpt.storage import objects as _objects  # noqa: E402
from test_accelerate import STOCK_SAVE, _env, fresh_accelerate_state, make, split, step  # noqa: E402, F401 - the autouse fixture

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(_objects, "_BACKOFF_S", 0.01)


@pytest.fixture
def installs():
    """install() that is always undone (a deliberately failed save may raise from remove())."""
    made = []
    yield lambda acc, **kw: made.append(LA.install(acc, **kw)) or made[-1]
    for h in made:
        try:
            h.uninstall()
        except Exception:  # noqa: BLE001
            pass
    import accelerate.checkpointing

    assert accelerate.checkpointing.save is STOCK_SAVE


@pytest.fixture(scope="module")
def moto():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield server.get_host_and_port()[1]
    server.stop()


def _options(port: int) -> dict:
    return {
        "key": "testing", "secret": "testing", "skip_instance_cache": True,
        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}", "region_name": "us-east-1"},
        "config_kwargs": {"retries": {"total_max_attempts": 1}},
    }  # fmt: skip


@pytest.fixture
def bucket(moto, request):
    fs = s3fs.S3FileSystem(**_options(moto))
    name = f"acc-{request.node.name.lower().replace('_', '-')[:40]}"
    fs.call_s3("create_bucket", Bucket=name)
    yield fs, name
    fs.rm(name, recursive=True)


def _restore(url, storage_options, tmp_path, **make_kw):
    """A fresh Accelerator (other init) with lazyckpt installed loads ``url``."""
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc, objs, customs = make(seed=1234, **make_kw)
    h = LA.install(acc, storage_options=storage_options, local_dir=str(tmp_path / "restore-tier"))
    try:
        acc.load_state(url)
        return C.snapshot(acc, *split(objs), customs)
    finally:
        h.uninstall()


def _same(got, want):
    for k in ("models", "opts", "scheds", "customs"):
        C.assert_same(got[k], want[k], k)
    C.assert_same(got["torch_rng"], want["torch_rng"], "torch_rng")


def test_memory_url_same_files_as_stock_manifest_last_restored_and_verified(tmp_path, installs, monkeypatch, capsys):
    acc, objs, customs = make(second_model=True, custom=1)
    gen = torch.Generator().manual_seed(0)
    step(acc, objs, gen)
    acc.save_state(str(tmp_path / "stock"))  # stock, before install
    h = installs(acc, local_dir=str(tmp_path / "tier"))
    order: list[str] = []
    transfer = _remote.RemoteTier.transfer

    def recording(self, url, *a, **k):
        order.append(url.rsplit("/", 1)[1])
        return transfer(self, url, *a, **k)

    monkeypatch.setattr(_remote.RemoteTier, "transfer", recording)
    want = C.snapshot(acc, *split(objs), customs)
    assert acc.save_state("memory://acc/run/ckpt-1") == "memory://acc/run/ckpt-1"
    step(acc, objs, gen)  # training goes on right after the call: the URL must hold the state at the call
    customs[0].bump()
    h.wait()
    mem = MemoryFileSystem()
    names = sorted(p.rsplit("/", 1)[1] for p in mem.ls("/acc/run/ckpt-1", detail=False))
    assert names == sorted([*C.file_tree(tmp_path / "stock"), _remote_folder.MANIFEST])
    assert order[-1] == _remote_folder.MANIFEST and sorted(order[:-1]) == C.file_tree(tmp_path / "stock")
    assert not [p for p in (tmp_path / "tier" / ".uploads").rglob("*") if p.is_file()]  # removed after upload
    _same(_restore("memory://acc/run/ckpt-1", None, tmp_path, second_model=True, custom=1), want)

    # lazyckpt verify: the manifest and every checkpoint file it names; without it, incomplete
    from lazyckpt.cli import main

    assert main(["verify", "memory://acc/run/"]) == 0
    out = capsys.readouterr().out
    assert "memory://acc/run/ckpt-1  (manifest" in out and "model.safetensors" in out and "FAIL" not in out
    mem.rm(f"/acc/run/ckpt-1/{_remote_folder.MANIFEST}")
    assert main(["verify", "memory://acc/run/ckpt-1"]) == 1
    assert "manifest .lazyckpt-complete is missing" in capsys.readouterr().out


def test_s3_round_trip_and_failed_upload_leaves_nothing_loadable(tmp_path, installs, bucket, moto):
    fs, name = bucket
    opts = _options(moto)
    acc, objs, customs = make()
    gen = torch.Generator().manual_seed(0)
    step(acc, objs, gen)
    h = installs(acc, storage_options=opts, local_dir=str(tmp_path / "tier"), upload_part_bytes=5 << 20)
    url = f"s3://{name}/run/ckpt-1"
    want = C.snapshot(acc, *split(objs), customs)
    acc.save_state(url)
    step(acc, objs, gen)
    h.wait()
    assert fs.exists(f"{name}/run/ckpt-1/{_remote_folder.MANIFEST}")
    assert not fs.call_s3("list_multipart_uploads", Bucket=name).get("Uploads")
    _same(_restore(url, opts, tmp_path), want)

    # Saving again to the same URL through a store that answers 500s: the old manifest is deleted
    # first, the upload fails with a typed error, and load_state refuses the prefix.
    proxy = FaultProxy(moto)
    try:
        h.uninstall()
        bad = dict(opts, client_kwargs=dict(opts["client_kwargs"], endpoint_url=proxy.endpoint))
        h = installs(acc, storage_options=bad, local_dir=str(tmp_path / "tier2"), upload_retries=1)
        proxy.add("fail", lambda method, path: method == "PUT" and "optimizer" in path, times=1000)
        acc.save_state(url)
        with pytest.raises(UploadError) as info:
            h.wait()
        assert info.value.url == url and os.path.isdir(info.value.local_path)
    finally:
        proxy.close()
    assert not fs.exists(f"{name}/run/ckpt-1/{_remote_folder.MANIFEST}")
    with pytest.raises(IncompleteCheckpointError):
        _restore(url, opts, tmp_path)


def test_s3_script_ending_without_wait_uploads_at_exit(tmp_path, bucket, moto):
    """save_state("s3://...") and the script ends: the handle drains before the interpreter's shutdown
    (s3fs cannot upload from a plain atexit hook), so the folder and its manifest reach the store."""
    fs, name = bucket
    opts = _options(moto)
    url, expected = f"s3://{name}/exit/ckpt", tmp_path / "expected.pt"
    r = run_python(
        [str(C.TESTS / "accelerate_scripts" / "exit_without_wait.py"), url, str(expected)]
        + [json.dumps(opts), str(tmp_path / "child-tier")],
        _env(),
        timeout=180,
    )
    assert r.returncode == 0 and "failed" not in r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
    assert fs.exists(f"{name}/exit/ckpt/{_remote_folder.MANIFEST}")
    want = torch.load(expected, weights_only=False)
    got = _restore(url, opts, tmp_path)
    for k in ("models", "opts", "scheds"):
        C.assert_same(got[k], want[k], k)


def test_refusals(tmp_path, installs):
    proj = ProjectConfiguration(project_dir="memory://acc/auto", automatic_checkpoint_naming=True)
    acc, objs, _ = make(project=proj)
    installs(acc)
    with pytest.raises(SaveRefusedError, match="automatic_checkpoint_naming"):
        acc.save_state()
    assert not os.path.exists("memory:")
