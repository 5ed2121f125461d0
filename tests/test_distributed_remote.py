"""DistributedCheckpointer saving to URLs: ``memory://`` in this process (a 1-rank gloo group), and
``s3://`` on moto's server (started here) with 2 real ranks, loaded back by stock DCP through
``FsspecReader``; failed uploads leave no ``.metadata`` and fail every rank."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap

import fsspec
import pytest
import s3fs
import torch
from fsspec.implementations.memory import MemoryFileSystem

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed unavailable", allow_module_level=True)
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader  # noqa: E402

import _launch  # noqa: E402
from _s3server import FaultProxy, moto_server, s3_options  # noqa: E402
from lazyckpt import UploadError  # noqa: E402
from lazyckpt.distributed import DistributedCheckpointer, DistributedUploadError, verify_checkpoint  # noqa: E402
from lazyckpt.storage import objects as _objects  # noqa: E402
from test_distributed import launch  # noqa: E402 - the 2-rank launcher (distributed_scripts/dist_worker.py)

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture(scope="module")
def one_rank_group():
    with _launch.one_rank_group():
        yield


@pytest.fixture(autouse=True)
def fast_backoff(monkeypatch):
    monkeypatch.setattr(_objects, "_BACKOFF_S", 0.01)


def _dckpt(tmp_path, **kw) -> DistributedCheckpointer:
    return DistributedCheckpointer(
        host_memory_budget=4 << 20, chunk_bytes=1 << 20, commit_timeout=20, fsync=False,
        local_dir=str(tmp_path / "tier"), **kw,
    )  # fmt: skip


def _state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(64, 64, generator=g), "b": torch.randn(300, generator=g), "meta": {"step": seed}}


def _load(url: str, like: dict, **storage_options) -> dict:
    state = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else {"step": -1}) for k, v in like.items()}
    dcp.load(state, storage_reader=FsspecReader(url, **storage_options), no_dist=True)
    return state


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def _names(fs, prefix: str) -> list[str]:
    """Object names under ``prefix``, a data file's per-save tag dropped (``__0_0.<tag>.distcp``)."""
    fs.invalidate_cache()
    return sorted(_kind(os.path.basename(p)) for p in fs.find(prefix))


def _kind(name: str) -> str:
    return re.sub(r"^(__\d+_0)\.[0-9a-f]+-\d+\.distcp$", r"\1.distcp", name)


def _data_file(fs, prefix: str, rank: int = 0) -> str:
    fs.invalidate_cache()
    (path,) = [p for p in fs.find(prefix) if os.path.basename(p).startswith(f"__{rank}_0.")]
    return path


# -- memory:// (one rank) ----------------------------------------------------------------------------


def test_memory_url_round_trip_stages_keep_local_and_overwrite(one_rank_group, tmp_path):
    fs = fsspec.filesystem("memory")
    url = "memory://dr1/run/step-1"
    first, second = _state(1), _state(2)
    with _dckpt(tmp_path, keep_local=True) as ckpt:
        h = ckpt.save(first, url, extra_files={"meta.pt": b"extra"})
        local = h.wait_local()
        assert h.local() and _kind(os.path.basename(local.path)) == "__0_0.distcp"
        stats = h.wait()
        assert h.done() and stats.path == url and stats.upload_s > 0 and stats.durable_s >= stats.local_s
        assert _names(fs, "/dr1/run/step-1") == [".lazyckpt-manifest.json", ".metadata", "__0_0.distcp", "meta.pt"]
        assert _same(_load(url, first), first)
        ckpt.save(second, url).wait()  # the same prefix again: replaced, the first save's data file deleted
    assert _same(_load(url, second), second)
    assert _names(fs, "/dr1/run/step-1") == [".lazyckpt-manifest.json", ".metadata", "__0_0.distcp", "meta.pt"]
    assert fs.cat("/dr1/run/step-1/meta.pt") == b"extra"  # not part of the second save: left as it was
    kept = tmp_path / "tier" / "memory" / "dr1" / "run" / "step-1"
    assert sorted(map(_kind, os.listdir(kept))) == [".lazyckpt-manifest.json", ".metadata", "__0_0.distcp", "meta.pt"]
    dcp.load(state := {k: torch.empty_like(v) for k, v in second.items() if k != "meta"}, checkpoint_id=str(kept))
    assert torch.equal(state["w"], second["w"])
    uploads = tmp_path / "tier" / ".uploads"
    assert not uploads.exists() or not list(uploads.iterdir())  # nothing left of the local folders


class FailingMemoryFS(MemoryFileSystem):
    """memory:// whose put_file refuses the names in ``refuse`` (fault injection by subclass)."""

    protocol = "failmem"
    refuse: tuple[str, ...] = ()

    @classmethod
    def _strip_protocol(cls, path):
        return super()._strip_protocol(path.removeprefix("failmem://"))

    def put_file(self, lpath, rpath, *args, **kwargs):
        if os.path.basename(lpath).startswith(FailingMemoryFS.refuse):
            raise PermissionError(f"refused: {os.path.basename(lpath)} (injected)")
        return super().put_file(lpath, rpath, *args, **kwargs)


@pytest.fixture
def failing(monkeypatch):
    fsspec.register_implementation("failmem", FailingMemoryFS, clobber=True)
    monkeypatch.setattr(FailingMemoryFS, "refuse", ())
    return FailingMemoryFS


@pytest.mark.parametrize("refused", ["__0_0.", ".lazyckpt-manifest", ".metadata"])
def test_memory_failed_upload_leaves_no_metadata_and_the_other_prefix_intact(
    one_rank_group, tmp_path, failing, refused
):
    fs = fsspec.filesystem("memory")
    good, bad = "failmem://dr2/run/good", "failmem://dr2/run/bad"
    with _dckpt(tmp_path) as ckpt:
        ckpt.save(_state(3), good).wait()
        ckpt.save(_state(4), bad).wait()  # a checkpoint at the prefix the failing save replaces
        failing.refuse = (refused,)
        h = ckpt.save(_state(5), bad)
        with pytest.raises(DistributedUploadError, match="refused") as err:
            h.wait()
        assert isinstance(err.value, UploadError) and err.value.ranks == (0,)
        assert err.value.url == bad and isinstance(err.value.__cause__, UploadError)
        if refused == "__0_0.":  # this rank's own file failed: its local copy is kept
            assert err.value.local_path and list(map(_kind, os.listdir(err.value.local_path))) == ["__0_0.distcp"]
        ckpt.wait()  # reported once, by the handle
    assert _same(_load(good, _state(3)), _state(3))  # another prefix: untouched
    if refused == "__0_0.":  # a data file failed: the previous checkpoint at the prefix is still whole
        assert _same(_load(bad, _state(4)), _state(4))
        assert verify_checkpoint(bad).ok
        assert _names(fs, "/dr2/run/bad") == [".lazyckpt-manifest.json", ".metadata", "__0_0.distcp"]
    else:  # the manifest or .metadata failed (shared keys touched): the previous one is hidden, nothing left
        assert _names(fs, "/dr2/run/bad") == []


def test_memory_refused_save_uploads_nothing_and_the_next_save_works(one_rank_group, tmp_path):
    from lazyckpt import SaveRefusedError

    fs = fsspec.filesystem("memory")
    url = "memory://dr4/run/x"
    with _dckpt(tmp_path) as ckpt:
        with pytest.raises(SaveRefusedError):
            ckpt.save({"w": torch.ones(8), "f": lambda: 0}, url)
        assert _names(fs, "/dr4") == []
        ckpt.save(_state(6), url).wait()
    assert _same(_load(url, _state(6)), _state(6))


def test_verify_a_distributed_checkpoint_by_url(one_rank_group, tmp_path, capsys):
    from lazyckpt.cli import main

    fs = fsspec.filesystem("memory")
    url = "memory://dr3/run/step-7"
    with _dckpt(tmp_path) as ckpt:
        ckpt.save(_state(7), url).wait()
    report = verify_checkpoint(url)
    assert report.ok and report.records == 3, report.problems
    assert main(["verify", "memory://dr3/run/"]) == 0
    assert "1 of 1 OK" in capsys.readouterr().out
    data_file = _data_file(fs, "/dr3/run/step-7")
    data = bytearray(fs.cat(data_file))
    data[len(data) // 2] ^= 0xFF
    fs.pipe(data_file, bytes(data))
    assert "CRC32 mismatch" in verify_checkpoint(url).problems[0]
    fs.rm("/dr3/run/step-7/.metadata")
    problems = verify_checkpoint(url).problems
    assert any("no .metadata" in p for p in problems), problems
    assert main(["verify", "-q", url]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and json.dumps(url)[1:-1] in out


# -- s3:// on moto's server, 2 ranks ------------------------------------------------------------------


@pytest.fixture(scope="module")
def moto():
    with moto_server() as port:
        yield port


@pytest.fixture
def s3_bucket(moto, request, monkeypatch):
    """A fresh bucket; the ranks get its storage options (direct, and through a fault proxy)."""
    options = s3_options(f"http://127.0.0.1:{moto}")
    fs = s3fs.S3FileSystem(**options)
    bucket = f"dist-{request.node.name.lower().replace('_', '-')[:40]}"
    fs.call_s3("create_bucket", Bucket=bucket)
    proxy = FaultProxy(moto)
    config = {"bucket": bucket, "options": options, "proxy_options": s3_options(proxy.endpoint)}
    monkeypatch.setenv("LAZYCKPT_TEST_S3", json.dumps(config))
    yield fs, bucket, options, proxy
    proxy.close()
    fs.rm(bucket, recursive=True)


def test_fsdp2_two_ranks_to_s3_loaded_by_stock_dcp_through_fsspec(tmp_path, s3_bucket, capsys):
    """FSDP2 + AdamW on 2 ranks saved to s3://; the workers load it back with stock dcp.load through
    FsspecReader and compare bitwise; here, one process loads the model (no_dist) and verifies."""
    from lazyckpt.cli import main

    fs, bucket, options, _ = s3_bucket
    results = launch("fsdp_s3", 2, tmp_path, timeout=180)
    for r in results:
        assert r["staged_after_save"] is False, r  # lazy on every rank, as to a local folder
        assert r["local_tier"] == [], r["local_tier"]  # local copies discarded once uploaded
    prefix = f"{bucket}/run/step-2"
    assert _names(fs, prefix) == [".lazyckpt-manifest.json", ".metadata", "__0_0.distcp", "__1_0.distcp"]
    dump = torch.load(tmp_path / "dump.pt", weights_only=False)
    model_sd = {k: torch.empty_like(v) for k, v in dump["model"].items()}
    dcp.load({"model": model_sd}, storage_reader=FsspecReader(f"s3://{prefix}", **options), no_dist=True)
    assert all(torch.equal(model_sd[k], dump["model"][k]) for k in model_sd)
    assert main(["verify", "--storage-options", json.dumps(options), f"s3://{bucket}/run/"]) == 0
    assert "1 of 1 OK" in capsys.readouterr().out
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")


def test_one_rank_upload_failing_for_good_fails_every_rank_and_leaves_no_metadata(tmp_path, s3_bucket):
    fs, bucket, options, proxy = s3_bucket
    proxy.add("fail", lambda method, path: method == "PUT" and "/run/bad/" in path, times=10_000, status=500)
    r0, r1 = launch("s3_upload_fails", 2, tmp_path, timeout=180)
    for r in (r0, r1):
        assert r["ranks"] == [1] and "rank 1" in r["message"], r
        assert r["waited_s"] < 30, r  # no hang: the failure is reported, not waited out
    assert r1["cause"] == "UploadError" and list(map(_kind, r1["kept"])) == ["__1_0.distcp"], (
        r1
    )  # its local copy is kept
    assert r0["cause"] == "NoneType" and r0["local_path"] is None
    assert _names(fs, f"{bucket}/run/bad") == []  # no .metadata, and rank 0's uploaded file deleted
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")  # rank 1's aborted
    good = torch.load(tmp_path / "good.pt", weights_only=True)  # the second save to run/good
    names = [".lazyckpt-manifest.json", ".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert _names(fs, f"{bucket}/run/good") == names  # the first save's data files were deleted
    like = {"w": torch.empty_like(good["w"]), "own0": torch.empty_like(good["own0"])}
    dcp.load(like, storage_reader=FsspecReader(f"s3://{bucket}/run/good", **options), no_dist=True)
    assert torch.equal(like["w"], good["w"]) and torch.equal(like["own0"], good["own0"])
    assert verify_checkpoint(f"s3://{bucket}/run/good", options).ok


def test_a_rank_killed_mid_upload_leaves_no_metadata_and_the_previous_checkpoint(tmp_path, s3_bucket):
    fs, bucket, options, _ = s3_bucket
    (r0, _) = launch("s3_sigkill", 2, tmp_path, timeout=180, expect_dead=(1,))
    assert r0["ranks"] == [1] and "did not report" in r0["message"], r0
    assert 2.5 < r0["waited_s"] < 30, r0["waited_s"]  # commit_timeout is 3 s
    assert _names(fs, f"{bucket}/run/killed") == []  # rank 0 deleted its upload; rank 1's never completed
    # The dead rank's multipart upload (part 1 may be in) was aborted by the coordinator.
    assert not fs.call_s3("list_multipart_uploads", Bucket=bucket).get("Uploads")
    good = torch.load(tmp_path / "good.pt", weights_only=True)
    assert verify_checkpoint(f"s3://{bucket}/run/good", options).ok
    like = {"w": torch.empty_like(good["w"])}
    dcp.load(like, storage_reader=FsspecReader(f"s3://{bucket}/run/good", **options), no_dist=True)
    assert torch.equal(like["w"], good["w"])


@pytest.mark.slow(reason="gloo processes upload to a real S3 server and exit without wait()")
def test_a_script_that_exits_without_wait_still_commits_its_upload(tmp_path, s3_bucket):
    """One rank, a 12 MiB multipart upload, no wait() or close(): the checkpointer is closed before
    the interpreter shuts down (atexit alone is too late for s3fs), so .metadata lands."""
    fs, bucket, options, _ = s3_bucket
    script = textwrap.dedent(f"""
        import socket, torch, torch.distributed as dist
        from lazyckpt.distributed import DistributedCheckpointer
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
        ckpt = DistributedCheckpointer(fsync=False, local_dir={str(tmp_path / "tier")!r},
                                       storage_options={options!r}, upload_part_bytes={5 << 20})
        ckpt.save({{"w": torch.ones(3 << 20)}}, "s3://{bucket}/exit/ckpt")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "failed" not in done.stderr, done.stderr
    assert ".metadata" in _names(fs, f"{bucket}/exit/ckpt")
    like = {"w": torch.zeros(3 << 20)}
    dcp.load(like, storage_reader=FsspecReader(f"s3://{bucket}/exit/ckpt", **options), no_dist=True)
    assert torch.equal(like["w"], torch.ones(3 << 20))
