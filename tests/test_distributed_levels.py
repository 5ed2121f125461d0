"""Multi-level distributed checkpoints with real processes (2 ranks, gloo, FSDP2 + AdamW plus
replicated state): a node-local memory level (each rank its own /dev/shm folder, standing for its
node) every step, a shared disk level every few, an S3 level (moto) as the slowest.

Each test starts its ranks with ``distributed_scripts/levels_worker.py`` (``tests/_launch.py``);
single-process checks (``lazyckpt.latest`` outside a job, stock ``dcp.load`` resharding to one
process) run here.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
import warnings
from pathlib import Path

import pytest
import torch

import _launch
import lazyckpt
from _util import assert_same
from lazyckpt import Level
from lazyckpt.errors import IncompleteCheckpointWarning

dcp = pytest.importorskip("torch.distributed.checkpoint")  # torch built without distributed: skipped

# dcp.load(no_dist=True) warns that it assumes a single process: that is the point here.
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
WORKER = Path(__file__).resolve().parent / "distributed_scripts" / "levels_worker.py"


@pytest.fixture
def run(tmp_path, monkeypatch, mem):
    """``run(scenario, world=2, **config)``: each rank's result; the memory level's base folder in
    /dev/shm (``run.mem``, one ``node<rank>`` folder per rank), the disk level ``run.disk``."""
    config = {"mem": mem, "disk": str(tmp_path / "disk")}

    def go(scenario: str, world: int = 2, expect_dead: tuple[int, ...] = (), timeout: float = 180, **extra):
        monkeypatch.setenv("LAZYCKPT_TEST_LEVELS", json.dumps({**config, **extra}))
        return _launch.launch(WORKER, scenario, world, tmp_path, timeout=timeout, expect_dead=expect_dead)

    go.mem, go.disk, go.config = Path(mem), Path(config["disk"]), config  # type: ignore[attr-defined]
    return go


def _flip_byte(path: Path) -> None:
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)[0]
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte ^ 0xFF]))


def _steps(folder: Path) -> list[str]:
    return sorted(n for n in os.listdir(folder) if not n.startswith("."))


def test_restart_from_node_memory_then_disk_then_resharded_to_one_process(run, tmp_path):
    """7 steps: memory (per node) every step, keep 2; disk every 3, keep 2. A restart on 2 ranks
    gets step 7 from each rank's own node memory (exact state, the replicated items included: each
    node keeps its own copy); with both of rank 1's memory copies corrupted, step 6 (the same on
    both ranks: rank 0 from memory, rank 1 from disk); with the memory wiped (a reboot), step 6
    from disk; one process loads the disk copy with stock DCP, resharding."""
    (r0, r1) = run("train", steps=7)
    assert r0["scopes"] == r1["scopes"] == [True, False]  # memory node-local, disk shared
    assert r0["levels_done"]["6"] == r1["levels_done"]["6"] == [0, 1]
    assert r0["levels_done"]["7"] == [0]
    for r in (0, 1):  # each node holds its own ranks' file only, keep=2, no temporaries
        node = run.mem / f"node{r}"
        assert _steps(node) == ["step-00000006", "step-00000007"]
        names = sorted(os.listdir(node / "step-00000007"))
        assert names == [".lazyckpt-manifest.json", ".metadata", f"__{r}_0.distcp"], names
    assert _steps(run.disk) == ["step-00000003", "step-00000006"]
    assert sorted(os.listdir(run.disk / "step-00000006")) == [
        ".lazyckpt-manifest.json", ".metadata", "__0_0.distcp", "__1_0.distcp"
    ]  # fmt: skip

    r0, r1 = run("restart")
    assert r0["found"]["step"] == r1["found"]["step"] == 7
    assert r0["found"]["level"] == r1["found"]["level"] == 0  # from each node's memory
    assert r0["found"]["path"] == str(run.mem / "node0" / "step-00000007")
    assert r1["found"]["path"] == str(run.mem / "node1" / "step-00000007")

    for step in (6, 7):  # rank 1's memory copies corrupted: step 7 nowhere else, step 6 on disk
        _flip_byte(run.mem / "node1" / f"step-{step:08d}" / "__1_0.distcp")
    r0, r1 = run("restart")
    assert r0["found"]["step"] == r1["found"]["step"] == 6
    assert (r0["found"]["level"], r1["found"]["level"]) == (0, 1)
    assert any("CRC32 mismatch" in w and "node1/step-00000007" in w for w in r1["warnings"]), r1["warnings"]

    shutil.rmtree(run.mem)  # a reboot
    r0, r1 = run("restart")
    assert r0["found"]["step"] == r1["found"]["step"] == 6
    assert r0["found"]["level"] == r1["found"]["level"] == 1

    # One process (another layout): stock DCP loads the disk copy, resharding.
    dump = torch.load(tmp_path / "dump-6.pt", weights_only=False)
    model_sd = {k: torch.empty_like(v) for k, v in dump["model"].items()}
    dcp.load({"model": model_sd}, checkpoint_id=str(run.disk / "step-00000006"), no_dist=True)
    assert_same(model_sd, dump["model"], "model", loose=True)
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(str(run.disk / "step-00000006"), str(whole))
    converted = torch.load(whole, weights_only=False)
    assert_same(converted["optim"]["state"], dump["optim"]["state"], "optim.state", loose=True)
    assert_same(converted["extra"], dump["extra"], "extra", loose=True)
    assert converted["step"] == 6


def test_a_node_memory_copy_is_not_taken_for_a_whole_checkpoint(run):
    """Outside the job (one process), a node-local folder is skipped, named, and the disk copy found."""
    run("train", steps=3, every=[1, 3])
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        found = lazyckpt.latest([Level(run.mem / "node0"), Level(run.disk)])
    assert (found.step, found.level) == (3, 1)
    said = [str(w.message) for w in seen if issubclass(w.category, IncompleteCheckpointWarning)]
    assert any("node-local copy" in s and "node0/step-00000003" in s for s in said), said


def test_a_failed_removal_of_an_old_step_fails_no_save_and_is_raised_once_by_its_owner(run):
    """Rank 0 cannot delete what retention drops (EBUSY, injected): each step is renamed away (its name free);
    no save fails (a save raising it on rank 0 alone would fail that step on every rank): every step reaches
    its levels, the levels' visible steps are as usual, and rank 0's close() raises the failure once."""
    (r0, r1) = run("train", steps=7, fail_remove=True)
    assert r0["close_raised"] == 16 and r1["close_raised"] is None  # EBUSY
    assert r0["levels_done"]["6"] == r1["levels_done"]["6"] == [0, 1]
    assert r0["levels_done"]["7"] == r1["levels_done"]["7"] == [0]
    assert _steps(run.mem / "node0") == ["step-00000006", "step-00000007"]
    assert _steps(run.disk) == ["step-00000003", "step-00000006"]


def test_a_rollback_removes_the_abandoned_steps_before_a_crash_could_resurrect_them(run):
    """7 steps (memory per node keep 2: 6, 7; disk every 3: 3, 6), then a rollback to the disk's
    step 3 and one save at step 4: the shared disk level's abandoned step 6 is gone when save()
    returns (not at the disk level's next commit, step 6), each node's 6 and 7 at its memory
    commit; with the memory wiped, the restart finds step 3, never the abandoned 6."""
    run("train", steps=7)
    r0, r1 = run("rollback")
    assert r0["disk_at_return"] == ["step-00000003"], r0["disk_at_return"]
    assert r0["levels_done"] == r1["levels_done"] == [0]
    assert r0["mem"] == r1["mem"] == ["step-00000004"]
    r0, r1 = run("restart")
    assert r0["found"]["step"] == r1["found"]["step"] == 4 and r0["restored"]
    shutil.rmtree(run.mem)  # a reboot
    r0, r1 = run("restart")
    assert r0["found"]["step"] == r1["found"]["step"] == 3
    assert r0["found"]["level"] == r1["found"]["level"] == 1


def test_a_rank_sigkilled_mid_run_restarts_on_the_step_every_rank_holds(run):
    """Rank 1 is SIGKILLed at its first write of step 5's save; rank 0 stops (its next collective
    fails). The restart agrees on one step on both ranks, and the state equals the dump of that step."""
    results = run("kill", expect_dead=(1,), kill_step=5)
    assert "stopped_by" in results[0]
    r0, r1 = run("restart")
    assert r0["found"]["step"] == r1["found"]["step"]
    # 4 when its memory commit ended on both nodes before the kill (what runs show), else an older one
    assert r0["found"]["step"] in (2, 3, 4), r0["found"]
    assert r0["restored"] and r1["restored"]


def test_enospc_on_the_disk_level_of_one_rank_fails_that_level_on_every_rank_memory_goes_on(run):
    (r0, r1) = run("enospc", steps=7)
    for r in (r0, r1):
        assert sorted(r["errors"]) == ["3", "6"], r["errors"]  # the disk-due steps
        for step in ("3", "6"):
            err = r["errors"][step]
            assert (err["level"], err["step"], err["ranks"]) == (1, int(step), [1]), err
            assert err["level_path"] == str(run.disk) and "level 1" in err["message"]
            assert err["levels_done"] == [0]  # the memory level has it
        assert [s for s, _ in r["ok_steps"]] == [1, 2, 4, 5, 7]
        assert r["disk"] == []  # nothing committed there, no staging folder left
    assert r1["errors"]["3"]["errno"] == 28 and r1["errors"]["3"]["cause"] == "OSError"
    assert r0["mem"] == r1["mem"] == ["step-00000006", "step-00000007"]


def test_extra_files_reach_every_level_folder_every_node_and_due_picks_the_levels(run, s3):
    """Rank 0's extra files (Lightning's ``meta.pt``) are in every level folder of a step: each
    node's memory folder (written by that node's leader), the shared disk, S3; listed in the
    manifests, so a flipped byte in one is found by the rank that reads that folder. ``due=``
    overrides ``every``; an index out of range is refused on every rank."""
    from lazyckpt.distributed import verify_checkpoint
    from lazyckpt.recovery.dcp import rank_problems

    options, fs = s3
    url = f"s3://levels/extra-{uuid.uuid4().hex[:8]}"
    r0, r1 = run("extra", s3=url, storage_options=options, every=[1, 3, 3], keep=[3, 3, 3])
    for r in (r0, r1):
        assert r["levels_done"] == {"1": [0], "2": [1], "3": [0, 1, 2], "4": [0]}, r["levels_done"]
        assert "due must hold level indices" in r["refused"]
    folders = [run.mem / f"node{r}" / f"step-{s:08d}" for r in (0, 1) for s in (1, 3, 4)]
    folders += [run.disk / "step-00000002", run.disk / "step-00000003"]
    for folder in folders:
        step = int(folder.name[5:])
        assert (folder / "meta.pt").read_bytes() == f"step {step} from rank 0".encode(), folder
        assert (folder / "note.txt").read_bytes() == b"n"
        manifest = json.loads((folder / ".lazyckpt-manifest.json").read_text())
        assert manifest["files"]["meta.pt"]["rank"] is None
    assert not (run.mem / "node0" / "step-00000002").exists()
    assert verify_checkpoint(run.disk / "step-00000003").ok
    assert fs.cat_file(f"{url[5:]}/step-00000003/meta.pt") == b"step 3 from rank 0"
    assert verify_checkpoint(f"{url}/step-00000003", options).ok
    node1 = run.mem / "node1" / "step-00000003"
    assert rank_problems(node1, 1, 2) == []
    _flip_byte(node1 / "meta.pt")
    assert any("meta.pt" in p for p in rank_problems(node1, 1, 2) or ["none"]), rank_problems(node1, 1, 2)
    fs.rm(url[5:], recursive=True)


def test_an_s3_level_as_the_slowest_restarts_both_ranks_when_memory_and_disk_are_gone(run, s3):
    """Memory every step, disk every 2, S3 (moto) every 4: each rank uploads its own file from its
    node's memory copy, the coordinator ``.metadata`` last; with memory and disk wiped, both ranks
    restart from S3 (stock DCP through FsspecReader), and one process verifies the prefix."""
    from lazyckpt.distributed import verify_checkpoint

    options, fs = s3
    prefix = f"levels/dist-{uuid.uuid4().hex[:8]}"
    url = f"s3://{prefix}"
    config = dict(s3=url, storage_options=options, every=[1, 2, 4], keep=[2, 2, 1])
    (r0, r1) = run("train", steps=9, **config)
    assert r0["levels_done"]["8"] == r1["levels_done"]["8"] == [0, 1, 2]
    fs.invalidate_cache()
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(prefix)) == ["step-00000008"]  # keep=1
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(f"{prefix}/step-00000008"))
    assert names[:2] == [".lazyckpt-manifest.json", ".metadata"] and len(names) == 4, names
    assert verify_checkpoint(f"{url}/step-00000008", options).ok
    assert not fs.call_s3("list_multipart_uploads", Bucket="levels").get("Uploads")

    shutil.rmtree(run.mem)
    shutil.rmtree(run.disk)
    r0, r1 = run("restart", **config)
    assert r0["found"] == {"step": 8, "level": 2, "path": f"{url}/step-00000008"}
    assert r1["found"] == r0["found"] and r1["restored"]
    fs.rm(prefix, recursive=True)
