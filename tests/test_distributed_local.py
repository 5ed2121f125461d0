"""DistributedCheckpointer in this process, on a 1-rank gloo group: the file layout, snapshots of
non-tensor values, stale tensors, overwriting, refusals, ``verify_checkpoint``."""

from __future__ import annotations

import dataclasses
import os
import zlib

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed unavailable", allow_module_level=True)
import torch.distributed.checkpoint as dcp  # noqa: E402

import _launch  # noqa: E402
from lazyckpt import CheckpointerOptions, SaveRefusedError, StaleTensorError  # noqa: E402
from lazyckpt.core.handle import wait_finished  # noqa: E402
from lazyckpt.core.job import Stage  # noqa: E402
from lazyckpt.distributed import DistributedCheckpointer, DistributedSaveError, verify_checkpoint  # noqa: E402
from lazyckpt.distributed._commit import cleanup_leftovers, staging_path  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def one_rank_group():
    with _launch.one_rank_group():
        yield


@pytest.fixture
def dckpt():
    c = DistributedCheckpointer(host_memory_budget=4 << 20, chunk_bytes=1 << 20, commit_timeout=10)
    yield c
    if not c.closed:
        c.close()


def load(folder, like: dict) -> dict:
    state = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else v) for k, v in like.items()}
    dcp.load(state, checkpoint_id=str(folder))
    return state


def test_each_item_is_a_torch_save_zip_and_the_manifest_crc_is_the_files(dckpt, tmp_path):
    """Every tensor item's slice is what torch.load reads (as FileSystemReader hands it over), and
    the CRC in the manifest is the whole file's."""
    import json
    import pickle

    state = {
        "a": torch.arange(1000, dtype=torch.float32),
        "b": torch.arange(12, dtype=torch.int64).reshape(3, 4).t(),  # not contiguous
        "c": torch.ones(3, dtype=torch.bool),
        "e": torch.empty(0),
        "x": {"lr": 0.1, "name": "sgd"},
    }
    dckpt.save(state, tmp_path / "c").wait()
    folder = tmp_path / "c"
    with open(folder / ".metadata", "rb") as fh:
        meta = pickle.load(fh)
    assert meta.storage_meta.checkpoint_id == str(folder)
    blob = (folder / "__0_0.distcp").read_bytes()
    for index, info in meta.storage_data.items():
        if index.fqn in ("a", "b", "c", "e"):
            import io

            t = torch.load(io.BytesIO(blob[info.offset : info.offset + info.length]), weights_only=True)
            assert torch.equal(t, state[index.fqn]), index.fqn
    manifest = json.loads((folder / ".lazyckpt-manifest.json").read_text())
    assert manifest["files"]["__0_0.distcp"]["crc32"] == zlib.crc32(blob)
    assert manifest["files"]["__0_0.distcp"]["size"] == len(blob)
    got = load(folder, {"a": state["a"], "b": state["b"], "c": state["c"], "e": state["e"], "x": {"lr": 0.0}})
    assert all(torch.equal(got[k], state[k]) for k in "abce") and got["x"] == {"lr": 0.1}


def test_non_tensor_values_are_snapshotted_in_save(dckpt, tmp_path):
    groups = {"lr": 0.1}
    h = dckpt.save({"w": torch.ones(4), "groups": groups}, tmp_path / "c")
    groups["lr"] = 99.0  # a scheduler after save()
    h.wait()
    got = load(tmp_path / "c", {"w": torch.ones(4), "groups": {"lr": 0.0}})
    assert got["groups"] == {"lr": 0.1}


def test_optimizer_owned_tensors_are_lazy_and_the_step_waits_for_them(tmp_path):
    """The stager is held until the optimizer step's guard is entered: save() returned with the
    copy pending, the step waited for it, and the checkpoint holds the weights at save()."""
    import threading

    import lazyckpt.core.engine as engine
    import lazyckpt.core.job as job_mod

    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(2, 64)).sum().backward()
    opt.step()  # the guard now knows this optimizer
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    gate, seen = threading.Event(), {}
    real_stage, real_release = engine.Engine._stage, job_mod.Job.release_guard

    def held_stage(self, job):
        gate.wait(10)  # never hang: a save that is not lazy fails the asserts below instead
        real_stage(self, job)

    def release_guard(self):
        seen["staged_when_step_began"] = self.stage >= job_mod.Stage.CPU_STAGED
        gate.set()
        real_release(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.Engine, "_stage", held_stage)
        mp.setattr(job_mod.Job, "release_guard", release_guard)
        with DistributedCheckpointer(host_memory_budget=4 << 20, chunk_bytes=1 << 20) as c:
            h = c.save({"model": model.state_dict()}, tmp_path / "c")
            assert not h.staged()
            model(torch.randn(2, 64)).sum().backward()
            opt.step()
            h.wait()
    assert seen == {"staged_when_step_began": False}
    got = load(tmp_path / "c", {"model": {k: torch.empty_like(v) for k, v in at_save.items()}})
    assert all(torch.equal(got["model"][k], v) for k, v in at_save.items())
    assert not torch.equal(model.weight, at_save["weight"])


def test_in_place_change_before_the_copy_fails_the_save_typed(tmp_path):
    import threading

    import lazyckpt.core.engine as engine

    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    gate = threading.Event()
    real_stage = engine.Engine._stage

    def held_stage(self, job):
        gate.wait(10)  # never hang: a save that is not lazy fails the asserts below instead
        real_stage(self, job)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.Engine, "_stage", held_stage)
        with DistributedCheckpointer(commit_timeout=10) as c:
            h = c.save({"w": model.weight}, tmp_path / "c")
            with torch.no_grad():
                model.weight.mul_(2)  # outside step(): the guard cannot hold it back
            gate.set()
            with pytest.raises(DistributedSaveError) as info:
                h.wait()
    assert info.value.ranks == (0,)
    assert isinstance(info.value.__cause__, StaleTensorError)
    assert not (tmp_path / "c").exists() and os.listdir(tmp_path) == []


def test_overwrite_swaps_the_folder_atomically(dckpt, tmp_path):
    dckpt.save({"w": torch.zeros(8)}, tmp_path / "c").wait()
    dckpt.save({"w": torch.ones(8)}, tmp_path / "c").wait()
    assert torch.equal(load(tmp_path / "c", {"w": torch.empty(8)})["w"], torch.ones(8))
    assert sorted(os.listdir(tmp_path)) == ["c"]  # the old folder is gone, no staging left
    assert verify_checkpoint(tmp_path / "c").ok


def test_unpicklable_value_is_refused_on_its_rank(dckpt, tmp_path):
    with pytest.raises(SaveRefusedError, match="rank 0"):
        dckpt.save({"w": torch.ones(2), "f": lambda: 0}, tmp_path / "c")
    dckpt.wait()  # not raised again
    assert not (tmp_path / "c").exists()


def test_a_file_at_the_path_is_refused(dckpt, tmp_path):
    (tmp_path / "c").write_text("not a folder")
    with pytest.raises(SaveRefusedError, match="not a folder"):
        dckpt.save({"w": torch.ones(2)}, tmp_path / "c")


def test_leftovers_of_dead_saves_are_removed_by_the_next_save(dckpt, tmp_path):
    dead = staging_path(str(tmp_path / "old"), "deadbeef", 3)
    os.makedirs(dead)
    open(os.path.join(dead, "__0_0.distcp"), "wb").close()
    dckpt.save({"w": torch.ones(2)}, tmp_path / "new").wait()
    assert sorted(os.listdir(tmp_path)) == ["new"]
    assert cleanup_leftovers(str(tmp_path)) == []


def test_verify_finds_corruption_truncation_and_missing_files(dckpt, tmp_path):
    dckpt.save({"w": torch.arange(4096, dtype=torch.float32)}, tmp_path / "c").wait()
    folder = tmp_path / "c"
    report = verify_checkpoint(folder)
    assert report.ok and report.records == 1 and report.format == "dcp"
    data = folder / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    assert any("CRC32 mismatch" in p for p in verify_checkpoint(folder).problems)
    data.write_bytes(bytes(raw[:-5]))
    assert any("expected" in p for p in verify_checkpoint(folder).problems)
    data.unlink()
    assert any("missing" in p for p in verify_checkpoint(folder).problems)
    assert not verify_checkpoint(tmp_path).ok  # not a checkpoint folder


def test_an_unseen_failure_is_raised_by_wait_not_by_the_next_save(dckpt, tmp_path, monkeypatch):
    """save() is collective: raising an earlier save's error there could leave other ranks in the
    planning collective. wait() raises it, once."""
    import errno

    import lazyckpt.storage.fs as _fs

    real = _fs.pwrite_all

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(_fs, "pwrite_all", enospc)
    h1 = dckpt.save({"w": torch.ones(1024)}, tmp_path / "a")
    h1.wait_staged()
    assert wait_finished(h1, 10)  # the commit thread has decided
    monkeypatch.setattr(_fs, "pwrite_all", real)
    h2 = dckpt.save({"w": torch.ones(1024)}, tmp_path / "b")  # does not raise h1's error
    with pytest.raises(DistributedSaveError, match="No space left") as info:
        dckpt.wait()
    assert info.value.errno == errno.ENOSPC and info.value.ranks == (0,)
    dckpt.wait()  # once
    h2.wait()
    assert sorted(os.listdir(tmp_path)) == ["b"]


@pytest.mark.gpu
def test_cuda_tensors_are_staged_lazily_and_load_on_cpu(tmp_path):
    """CUDA parameters and optimizer state (the core's copy stream and events), planning on gloo."""
    model = torch.nn.Linear(256, 256).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 256, device="cuda")).sum().backward()
    opt.step()
    at_save = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    with DistributedCheckpointer(host_memory_budget=4 << 20, chunk_bytes=1 << 20) as c:
        h = c.save({"model": model.state_dict(), "optim": opt.state_dict()}, tmp_path / "c")
        model(torch.randn(4, 256, device="cuda")).sum().backward()
        opt.step()  # the compute stream waits for the copies
        h.wait()
    got = load(tmp_path / "c", {"model": {k: torch.empty_like(v) for k, v in at_save.items()}})
    assert all(torch.equal(got["model"][k], v) for k, v in at_save.items())
    assert verify_checkpoint(tmp_path / "c").ok


def test_a_folder_that_is_no_checkpoint_is_refused_not_replaced(dckpt, tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "notes.txt").write_text("keep me")
    with pytest.raises(SaveRefusedError, match="holds no checkpoint"):
        dckpt.save({"w": torch.ones(2)}, tmp_path / "runs")
    assert (tmp_path / "runs" / "notes.txt").read_text() == "keep me"


def test_a_checkpoint_moved_aside_by_a_dead_save_is_restored_not_deleted(tmp_path):
    """swap_in() without RENAME_EXCHANGE moves the old folder aside first; if the process dies
    right then, the next cleanup puts it back."""
    aside = staging_path(str(tmp_path / "c"), "deadbeef", 1, old=True)
    os.makedirs(aside)
    (tmp_path / "x").mkdir()
    open(os.path.join(aside, ".metadata"), "wb").close()
    assert cleanup_leftovers(str(tmp_path)) == []
    assert sorted(os.listdir(tmp_path)) == ["c", "x"] and os.listdir(tmp_path / "c") == [".metadata"]


def test_zero_copy_writes_large_optimizer_tensors_from_their_memory(tmp_path, monkeypatch):
    """As in the core: with direct I/O, a large CPU tensor an optimizer owns is written straight
    from its memory (no staging copy), its data placed at its address's position within a page."""
    import json
    import pickle

    import lazyckpt.core.engine as engine
    from lazyckpt.core.pool import PAGE

    model = torch.nn.Linear(1024, 512)  # a 2 MiB weight
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(2, 1024)).sum().backward()
    opt.step()
    at_save = {k: v.clone() for k, v in model.state_dict().items()}
    live: list[str] = []
    real_queue_live = engine.Engine._queue_live

    def queue_live(self, job, src):
        live.append(src.checks[0][0])
        real_queue_live(self, job, src)

    monkeypatch.setattr(engine.Engine, "_queue_live", queue_live)
    with DistributedCheckpointer(direct_io=True, host_memory_budget=4 << 20, chunk_bytes=1 << 20) as c:
        h = c.save({"model": model.state_dict()}, tmp_path / "c")
        model(torch.randn(2, 1024)).sum().backward()
        opt.step()  # claims and copies the live pieces no writer has started
        h.wait()
    assert live == ["model.weight"]
    folder = tmp_path / "c"
    got = load(folder, {"model": {k: torch.empty_like(v) for k, v in at_save.items()}})
    assert all(torch.equal(got["model"][k], v) for k, v in at_save.items())
    with open(folder / ".metadata", "rb") as fh:
        info = next(i for idx, i in pickle.load(fh).storage_data.items() if idx.fqn == "model.weight")
    blob = (folder / "__0_0.distcp").read_bytes()
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(blob[info.offset : info.offset + info.length])) as zf:
        record = zf.getinfo("archive/data/0")
        assert zf.testzip() is None
    header = info.offset + record.header_offset
    name_len = int.from_bytes(blob[header + 26 : header + 28], "little")
    extra_len = int.from_bytes(blob[header + 28 : header + 30], "little")
    data_at = header + 30 + name_len + extra_len
    assert data_at % PAGE == model.weight.data_ptr() % PAGE  # the parameter never moved: updates are in place
    manifest = json.loads((folder / ".lazyckpt-manifest.json").read_text())
    assert manifest["files"]["__0_0.distcp"]["crc32"] == zlib.crc32(blob)


def test_publish_without_exchange_puts_the_old_checkpoint_back_when_the_rename_fails(tmp_path, monkeypatch):
    from lazyckpt.storage import fs as _fs

    (tmp_path / "final").mkdir()
    (tmp_path / "final" / ".metadata").write_text("old")
    (tmp_path / "staging").mkdir()
    real_rename = os.rename

    def rename(a, b):
        if str(a).endswith("staging"):
            raise OSError(5, "EIO (injected)")
        real_rename(a, b)

    monkeypatch.setattr(_fs, "_exchange", lambda a, b: False)
    monkeypatch.setattr(_fs, "rename", rename)
    with pytest.raises(OSError, match="injected"):
        _fs.swap_in(str(tmp_path / "staging"), str(tmp_path / "final"), str(tmp_path / "old"), fsync=True)
    assert (tmp_path / "final" / ".metadata").read_text() == "old"
    assert sorted(os.listdir(tmp_path)) == ["final", "staging"]


def test_publish_says_when_the_new_checkpoint_is_in_place_but_not_durable(tmp_path, monkeypatch):
    from lazyckpt.errors import NotDurableError
    from lazyckpt.storage import fs as _fs

    (tmp_path / "final").mkdir()
    (tmp_path / "final" / ".metadata").write_text("old")
    (tmp_path / "staging").mkdir()
    (tmp_path / "staging" / ".metadata").write_text("new")

    def fsync_dir(path):
        raise OSError(5, "EIO (injected)")

    monkeypatch.setattr(_fs, "fsync_dir", fsync_dir)
    with pytest.raises(NotDurableError):
        _fs.swap_in(str(tmp_path / "staging"), str(tmp_path / "final"), str(tmp_path / "old"), fsync=True)
    assert (tmp_path / "final" / ".metadata").read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["final"]  # the old one deleted all the same


# -- confirmation on the training thread, and errors reported once (the core's ledger) --------------


def _lazy_model():
    """A model whose optimizer the guard knows: its tensors are copied lazily by a save."""
    model = torch.nn.Linear(32, 32)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model(torch.randn(2, 32)).sum().backward()
    opt.step()
    return model, opt


def _record_confirmations(monkeypatch) -> list[str]:
    """Names of the threads that re-checked a save's versions once its copies were over."""
    import threading

    import lazyckpt.core.job as job_mod

    threads: list[str] = []
    real_verify = job_mod.Job._verify

    def verify(self):
        if self.stage >= job_mod.Stage.READ:  # the copies are over: this check confirms the save
            threads.append(threading.current_thread().name)
        return real_verify(self)

    monkeypatch.setattr(job_mod.Job, "_verify", verify)
    return threads


@pytest.mark.parametrize("entry", ["handle.wait", "ckpt.wait", "close", "wait_staged", "next save"])
def test_a_lazy_save_is_confirmed_on_the_training_thread_never_the_commit_thread(tmp_path, monkeypatch, entry):
    """Issue 11 item 2: a rank's file is committed only after its lazy tensors' versions were checked
    again on the training thread once the copies were over. The commit thread waits for the file
    without confirming it; each training-thread entry point confirms (without an optimizer step:
    no deadlock with the commit thread either)."""
    model, _ = _lazy_model()
    threads = _record_confirmations(monkeypatch)
    c = DistributedCheckpointer(host_memory_budget=4 << 20, chunk_bytes=1 << 20, commit_timeout=30)
    try:
        h = c.save({"model": model.state_dict()}, tmp_path / "c")
        job = h._part.handle._o.confirm.__self__  # the rank file's core job (its bound confirmation hook)
        assert job.lazy and job.wait_for(Stage.READ, 10)  # copies over: only a confirmation is missing
        assert not h.done()
        if entry == "handle.wait":
            h.wait(timeout=20)
        elif entry == "ckpt.wait":
            c.wait(timeout=20)
        elif entry == "close":
            c.close()
        elif entry == "wait_staged":
            c.wait_staged(timeout=20)
            wait_finished(h, 20)  # not a confirming wait: wait_staged() did it
        else:
            c.save({"w": torch.ones(2)}, tmp_path / "d")
            wait_finished(h, 20)
        assert h.done() and h.exception() is None
    finally:
        if not c.closed:
            c.close()
    assert threads == ["MainThread"]
    assert verify_checkpoint(tmp_path / "c").ok


def _fail_writes(monkeypatch):
    import errno

    import lazyckpt.storage.fs as _fs

    def enospc(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device (injected)")

    monkeypatch.setattr(_fs, "pwrite_all", enospc)


def test_an_error_raised_by_handle_wait_is_not_raised_again_by_wait_or_close(tmp_path, monkeypatch):
    """One ledger: the rank file's own WriteError is the distributed error's cause, not a second
    error; once handle.wait() raised it, neither wait() nor close() raises anything."""
    from lazyckpt import WriteError

    _fail_writes(monkeypatch)
    c = DistributedCheckpointer(host_memory_budget=4 << 20, chunk_bytes=1 << 20, commit_timeout=10)
    h = c.save({"w": torch.ones(1024)}, tmp_path / "a")
    with pytest.raises(DistributedSaveError, match="No space left") as info:
        h.wait(timeout=20)
    assert isinstance(info.value.__cause__, WriteError) and h.reported
    c.wait()
    c.close()


def test_an_unseen_error_is_raised_once_by_close(tmp_path, monkeypatch):
    _fail_writes(monkeypatch)
    c = DistributedCheckpointer(host_memory_budget=4 << 20, chunk_bytes=1 << 20, commit_timeout=10)
    h = c.save({"w": torch.ones(1024)}, tmp_path / "a")
    assert h.exception(timeout=20) is not None  # does not count as seen
    with pytest.raises(DistributedSaveError, match="No space left"):
        c.close()
    c.close()  # closed: nothing again
    assert h.reported


def test_a_done_callback_may_wait_for_later_saves(tmp_path):
    """Done-callbacks run on the core's callback thread, not on the commit thread that commits the
    saves they wait for."""
    import threading

    results: list[object] = []
    called = threading.Event()
    with DistributedCheckpointer(host_memory_budget=4 << 20, chunk_bytes=1 << 20, commit_timeout=10) as c:
        gate = threading.Event()

        def on_done(handle):
            gate.wait(10)  # the second save is pending by now
            try:
                c.wait(timeout=5)
                results.append("ok")
            except TimeoutError as exc:
                results.append(exc)
            called.set()

        h1 = c.save({"w": torch.ones(4)}, tmp_path / "a")
        h1.add_done_callback(on_done)
        c.save({"w": torch.ones(4)}, tmp_path / "b")
        gate.set()
        assert called.wait(30)
    assert results == ["ok"]


# -- lazyckpt verify ----------------------------------------------------------------------------------


def test_cli_verify_checks_a_distributed_folder_with_its_manifest(dckpt, tmp_path, capsys):
    """``lazyckpt verify`` on a distributed checkpoint: the folder as a whole (never a ``.distcp``
    file through the single-file verifier, which would call it 'not a checkpoint'); a corrupted
    data file fails it; a dead save's staging folder is a note, not a failure."""
    import json

    from lazyckpt.cli import main

    dckpt.save({"w": torch.arange(4096, dtype=torch.float32), "step": 3}, tmp_path / "run" / "c").wait()
    folder = tmp_path / "run" / "c"
    dead = staging_path(str(tmp_path / "run" / "d"), "deadbeef", 1)
    os.makedirs(dead)
    open(os.path.join(dead, "__0_0.distcp"), "wb").close()
    for target in (tmp_path, folder, folder / "__0_0.distcp"):
        capsys.readouterr()
        assert main(["verify", "--json", str(target)]) == 0, target
        doc = json.loads(capsys.readouterr().out)
        results = [r for r in doc["results"] if r["kind"] != "temporary"]
        assert [(r["kind"], r["format"], r["path"]) for r in results] == [("dcp-folder", "dcp", str(folder))]
        assert results[0]["records"] >= 2 and doc["checked"] == 1
    assert [r["path"] for r in doc["results"] if r["kind"] == "temporary"] == []
    capsys.readouterr()
    assert main(["verify", "--json", str(tmp_path)]) == 0
    notes = [r["path"] for r in json.loads(capsys.readouterr().out)["results"] if r["kind"] == "temporary"]
    assert notes == [dead]
    data = folder / "__0_0.distcp"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x10
    data.write_bytes(bytes(raw))
    capsys.readouterr()
    assert main(["verify", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "CRC32 mismatch" in out and "0 of 1 OK, 1 FAILED" in out


def test_the_global_plan_is_reused_while_the_state_keeps_its_structure(tmp_path, monkeypatch):
    """Saves of the same structure reuse the previous plan (no plans exchanged, no shard offsets
    recomputed); a changed shape or a new key plans afresh. Every checkpoint loads as saved."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    calls = {"local": 0, "global": 0}
    real_local, real_global = DefaultSavePlanner.create_local_plan, DefaultSavePlanner.create_global_plan

    def local_plan(self):
        calls["local"] += 1
        return real_local(self)

    def global_plan(self, plans):
        calls["global"] += 1
        return real_global(self, plans)

    monkeypatch.setattr(DefaultSavePlanner, "create_local_plan", local_plan)
    monkeypatch.setattr(DefaultSavePlanner, "create_global_plan", global_plan)
    mesh = init_device_mesh("cpu", (1,))
    w = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh, [Shard(0)])
    saved = []
    with DistributedCheckpointer() as c:

        def save(name, state):
            c.save(state, tmp_path / name).wait()
            saved.append((name, {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in state.items()}))
            saved[-1][1].update({k: v.clone() for k, v in saved[-1][1].items() if isinstance(v, torch.Tensor)})
            return dict(calls)

        assert save("a", {"w": w, "t": torch.ones(5), "step": 1}) == {"local": 1, "global": 1}
        w._local_tensor.add_(1)
        assert save("b", {"w": w, "t": torch.full((5,), 2.0), "step": 2}) == {"local": 1, "global": 1}
        assert save("c", {"w": w, "t": torch.ones(6), "step": 3}) == {"local": 2, "global": 2}  # a shape changed
        assert save("d", {"w": w, "t": torch.ones(6), "step": 4, "extra": 7}) == {"local": 3, "global": 3}  # a key
        assert save("e", {"w": w, "t": torch.ones(6), "step": 5, "extra": 8}) == {"local": 3, "global": 3}
    for name, expected in saved:
        like = {k: (torch.empty_like(v) if isinstance(v, torch.Tensor) else None) for k, v in expected.items()}
        dcp.load(like, checkpoint_id=str(tmp_path / name))
        for k, v in expected.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(like[k], v), (name, k)
            else:
                assert like[k] == v, (name, k)
        assert verify_checkpoint(tmp_path / name).ok


# -- options: one CheckpointerOptions (options=), keywords, or both, as LazyCheckpointer takes them --


def _inner_options(ckpt: DistributedCheckpointer) -> CheckpointerOptions:
    return ckpt._inner.options  # the test looks inside: which options reached the engine


def test_options_as_one_value_keywords_or_both():
    opts = CheckpointerOptions(host_memory_budget=4 << 20, chunk_bytes=1 << 20, writer_threads=2, fsync=False)
    with DistributedCheckpointer(opts, commit_timeout=7) as positional:
        assert positional.options == opts and _inner_options(positional) == opts
        assert positional.commit_timeout == 7.0
    with DistributedCheckpointer(options=opts) as named:
        assert named.options == opts
    with DistributedCheckpointer(options=opts, writer_threads=3) as both:  # keywords override
        assert both.options == dataclasses.replace(opts, writer_threads=3)
        assert _inner_options(both).writer_threads == 3
    with DistributedCheckpointer(host_memory_budget=4 << 20, fsync=False) as keywords:  # as before
        assert keywords.options.fsync is False and keywords.options.host_memory_budget == 4 << 20


def test_bad_options_are_refused_before_anything_starts():
    with pytest.raises(TypeError, match="CheckpointerOptions"):
        DistributedCheckpointer({"fsync": False})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="skip"):
        DistributedCheckpointer(CheckpointerOptions(on_backpressure="skip"))
    with pytest.raises(ValueError, match="skip"):
        DistributedCheckpointer(on_backpressure="skip")
    with pytest.raises(ValueError, match="commit_timeout"):
        DistributedCheckpointer(commit_timeout=0)
    with pytest.raises(TypeError):
        DistributedCheckpointer(no_such_option=1)
