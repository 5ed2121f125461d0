"""MultiLevelCheckpoint with ModelParallelStrategy (FSDP2 through ``configure_model``), 2 CPU processes
launched by Lightning: every rank saves its shards to each due level as a DCP folder that stock
Lightning resumes from (``tests/lightning_scripts/levels_sharded.py`` runs the fits)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any

import pytest

pytest.importorskip("lightning")

import torch  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

from _launch import rank_env, run_session  # noqa: E402
from _util import assert_same  # noqa: E402
from lazyckpt.distributed import verify_checkpoint  # noqa: E402

pytestmark = [pytest.mark.integration]
if sys.platform != "linux":
    pytestmark.append(pytest.mark.skip(reason="gloo on loopback, Lightning's subprocess launcher"))

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(TESTS, "lightning_scripts", "levels_sharded.py")
FILES = {".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt", ".lazyckpt-manifest.json"}
META_KEYS = ("epoch", "global_step", "loops", "lr_schedulers")


def _phase(out: Any, phase: str, ok: bool = True) -> list[dict[str, Any]]:
    """One launch of the script (Lightning starts rank 1); each rank's report."""
    env = rank_env({"PYTHONPATH": os.path.dirname(TESTS)}, drop=("LOCAL_RANK", "RANK", "WORLD_SIZE"))
    proc = run_session([SCRIPT, str(out), phase], timeout=240, env=env)
    assert (proc.returncode == 0) == ok, proc.stdout[-6000:]
    reports = []
    for rank in (0, 1):
        path = out / f"{phase}-rank{rank}.json"
        assert path.exists(), f"rank {rank} wrote no report (rc={proc.returncode}):\n{proc.stdout[-6000:]}"
        reports.append(json.loads(path.read_text()))
    return reports


def _steps(folder: Any) -> list[int]:
    return sorted(int(n[5:]) for n in os.listdir(folder) if n.startswith("step-"))


def _end(out: Any, name: str) -> dict[str, Any]:
    return torch.load(out / f"{name}-end.pt", weights_only=False)


def _same_as_stock(folder: Any, stock: Any, tmp: Any) -> None:
    """A level folder holds what stock ModelParallel saved at that step: every item, and meta.pt."""
    assert set(os.listdir(folder)) == FILES, os.listdir(folder)
    assert verify_checkpoint(folder).ok
    got, want = tmp / "got.pt", tmp / "want.pt"
    dcp_to_torch_save(str(folder), got)
    dcp_to_torch_save(str(stock), want)
    assert_same(torch.load(got, weights_only=False), torch.load(want, weights_only=False), str(folder), loose=True)
    meta = torch.load(folder / "meta.pt", weights_only=False)
    stock_meta = torch.load(stock / "meta.pt", weights_only=False)
    for key in META_KEYS:
        assert_same(meta[key], stock_meta[key], f"{folder}/meta.pt[{key}]")


@pytest.mark.slow(reason="two-process ModelParallelStrategy fits over levels, then resumes")
@pytest.mark.timeout(900)
def test_model_parallel_levels_are_stock_folders_and_resume_from_latest(tmp_path):
    """Stock runs first (the reference), then: a fit with a memory level every step and a disk level
    every 3 to step 5; each level folder is what stock ModelCheckpoint saved at that step. A new
    launch resumes with one line, ``fit(ckpt_path=lazyckpt.latest(levels).path)`` (latest() called
    before fit, torch.distributed not yet initialized): from memory, step 5, ending exactly as stock
    Lightning's own resume from its own step-5 folder (stock's resume is the reference: it does not
    continue its uninterrupted run bit for bit here, see the script), its level folders again what
    that stock resume saved. With the memory wiped, the disk level's step 6; and a plain
    ModelParallel fit without lazyckpt resumes from the disk level's step 3."""
    _phase(tmp_path, "stock")
    stock = tmp_path / "stock"

    for report in _phase(tmp_path, "first"):
        assert report["global_step"] == 5 and report["raised"] is None
    mem, disk = tmp_path / "mem", tmp_path / "disk"
    assert _steps(mem) == [4, 5] and _steps(disk) == [3]
    for folder, step in ((mem / "step-00000004", 4), (mem / "step-00000005", 5), (disk / "step-00000003", 3)):
        _same_as_stock(folder, stock / f"step{step}.ckpt", tmp_path)

    for report in _phase(tmp_path, "resume"):
        assert report["found"] == [5, 0, str(mem / "step-00000005")], report
        assert report["initialized_at_latest"] is False and report["global_step"] == 8
    assert_same(_end(tmp_path, "resume"), _end(tmp_path, "stock-from5"), "resumed from the memory level")
    assert _steps(mem) == [7, 8] and _steps(disk) == [3, 6]
    for folder, step in ((mem / "step-00000007", 7), (mem / "step-00000008", 8), (disk / "step-00000006", 6)):
        _same_as_stock(folder, tmp_path / "stock5" / f"step{step}.ckpt", tmp_path)  # the resumed fit's saves

    shutil.rmtree(mem)  # a reboot
    for report in _phase(tmp_path, "wiped"):
        assert report["found"] == [6, 1, str(disk / "step-00000006")], report
        assert report["global_step"] == 8
    assert_same(_end(tmp_path, "wiped"), _end(tmp_path, "stock-from5-6"), "resumed from the disk level")
    assert_same(_end(tmp_path, "plain3"), _end(tmp_path, "stock-from3"), "plain ModelParallel from the disk level")
    assert not [n for level in (mem, disk) for n in os.listdir(level) if n.startswith(".")]  # no staging left


@pytest.mark.slow(reason="a two-process ModelParallelStrategy fit with a full level")
@pytest.mark.timeout(300)
def test_model_parallel_enospc_on_one_rank_fails_fit_on_both_with_the_level_error(tmp_path):
    """Rank 1's disk level is full: the disk level's save fails on both ranks alike
    (``DistributedLevelError`` naming level 1 and rank 1), ``fit`` raises it on both at the same
    step, each rank its own error, although rank 1 learns of it later than rank 0 (forced: the
    ranks settle their level saves before raising); nobody hangs; nothing is committed at the disk
    level, the memory level has the newest steps."""
    reports = _phase(tmp_path, "enospc", ok=False)
    for report in reports:
        assert report["raised"] == "DistributedLevelError", report
        assert report["at_step"] < 8, report  # raised while training, rank 1 learning it late (forced)
        assert report["level"] == 1 and report["ranks"] == [1], report
        assert "level 1" in report["message"] and "No space left" in report["message"], report
    assert reports[1]["errno"] == 28
    assert os.listdir(tmp_path / "disk") == []
    assert len(_steps(tmp_path / "mem")) == 2


@pytest.mark.slow(reason="two-process ModelParallelStrategy fits with replicas")
@pytest.mark.timeout(600)
def test_model_parallel_levels_with_replicas_hold_each_nodes_steps_in_the_others_memory(tmp_path):
    """Each of the 2 ranks stands for a node (its own memory folder), ``Level(..., replicas=1)``
    through MultiLevelCheckpoint: every step's shards are committed in the rank's own folder and
    held whole (index written) in the other's; the fit ends exactly as the same fit without
    replicas, with no lazyckpt warning. (A resume from a replica is not run here: Lightning's
    ModelParallel load broadcasts rank 0's ckpt_path, so one machine cannot give each rank its own
    node's folder; tests/test_node_loss.py covers the restore with DistributedCheckpointer.)"""
    _phase(tmp_path, "first")
    reports = _phase(tmp_path, "replicas")
    assert [r["global_step"] for r in reports] == [5, 5] and not any(r["warnings"] for r in reports), reports
    assert_same(_end(tmp_path, "replicas"), _end(tmp_path, "first"))
    for node, other in ((0, 1), (1, 0)):
        own = tmp_path / "memr" / f"node{node}"
        assert _steps(own) == [4, 5]
        assert f"__{node}_0.distcp" in os.listdir(own / "step-00000005")
        held = own / "replicas" / f"node-{other:04d}"
        assert _steps(held) == [4, 5]  # keep=2 on the replicas too
        for step in (4, 5):
            names = set(os.listdir(held / f"step-{step:08d}"))
            assert f"__{other}_0.distcp" in names and f".lazyckpt-replica-from-{other}.json" in names, names
    assert _steps(tmp_path / "diskr") == [3]
