"""Node loss (``Level(replicas=k)``): gloo ranks standing for nodes (``per_node`` ranks share one
/dev/shm folder, ``mem/node<n>``), FSDP2 + AdamW, a replicated memory level every step and a shared
disk level every 3. A node's memory is wiped after the job (a replaced node), and a fresh job
agrees on the newest step and loads it exactly (stock DCP, compared with the dump taken before each
save); both nodes wiped: the disk level; faults: a flipped byte in a replica, ENOSPC in a partner's
memory, a whole node SIGKILLed while replicas are in flight."""

from __future__ import annotations

import errno
import json
import os
import shutil
import uuid
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed unavailable", allow_module_level=True)

import _launch  # noqa: E402
from test_distributed_levels import _flip_byte  # noqa: E402

WORKER = Path(__file__).resolve().parent / "distributed_scripts" / "levels_worker.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


CONFIG = {"per_node": 2, "replicas": 1, "every": [1, 3]}


def _launcher(workdir: Path, mem: str):
    config = {**CONFIG, "mem": mem, "disk": str(workdir / "disk")}

    def go(scenario: str, world: int = 4, expect_dead: tuple[int, ...] = (), timeout: float = 240, **extra):
        env = {"LAZYCKPT_TEST_LEVELS": json.dumps({**config, **extra})}
        return _launch.launch(WORKER, scenario, world, workdir, timeout=timeout, expect_dead=expect_dead, env=env)

    go.mem, go.disk = Path(mem), Path(config["disk"])  # type: ignore[attr-defined]
    return go


@pytest.fixture(scope="module")
def replicated(tmp_path_factory):
    """One run of ``replicate`` (4 ranks as 2 nodes, 5 steps), shared by the tests that start from
    its result: (each rank's result, the launcher whose folders hold it). A test copies the folders
    (``run.start_from``) before it wipes or corrupts anything."""
    workdir = tmp_path_factory.mktemp("replicated")
    mem = f"/dev/shm/lazyckpt-test-{uuid.uuid4().hex[:12]}"
    go = _launcher(workdir, mem)
    try:
        yield go("replicate", steps=5), go
    finally:
        shutil.rmtree(mem, ignore_errors=True)


@pytest.fixture
def run(tmp_path, mem):
    go = _launcher(tmp_path, mem)

    def start_from(shared) -> list[dict]:
        """This test's own copy of a shared run's memory and disk levels and state dumps; its results."""
        results, source = shared
        shutil.copytree(source.mem, go.mem, symlinks=True)
        shutil.copytree(source.disk, go.disk, symlinks=True)
        for dump in source.disk.parent.glob("dump-*.pt"):
            shutil.copy2(dump, tmp_path / dump.name)
        return results

    go.start_from = start_from  # type: ignore[attr-defined]
    return go


def _wipe(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.mkdir()  # a replaced node: the folder is there, empty


def test_two_nodes_a_wiped_node_restarts_from_its_partners_replica_then_both_wiped_from_disk(run, replicated):
    """4 ranks as 2 nodes, 5 steps, memory keep 2 with replicas=1: each node holds the other's two
    newest steps; node 1 wiped: the restart agrees on step 5 everywhere, node 1's folder got it back
    from node 0's replica (ranks 2, 3 read their own node's folder), the state is exact. Both nodes
    wiped: step 3 from disk."""
    results = run.start_from(replicated)
    for res in results:
        assert res["stats"]["steps"] == 5 and not res["stats"]["not_replicated"], res["stats"]
        assert res["stats"]["sent"] > 0 and res["stats"]["received"] > 0
        assert not [w for w in res["warnings"] if w.startswith("Replication")], res["warnings"]
    tree0 = results[0]["tree"]
    held = sorted({p.split("/")[2] for p in tree0 if p.startswith("replicas/node-0001/")})
    assert held == ["step-00000004", "step-00000005"], tree0  # keep=2 applies to the replicas
    for name in ("__2_0.distcp", "__3_0.distcp", ".metadata", ".lazyckpt-manifest.json"):
        assert f"replicas/node-0001/step-00000005/{name}" in tree0, tree0
    assert not [p for p in tree0 if p.endswith(".tmp")], tree0
    _wipe(run.mem / "node1")
    back = run("restart")
    for r, res in enumerate(back):
        assert res["found"]["step"] == 5 and res["found"]["level"] == 0, res["found"]
        assert res["found"]["path"] == str(run.mem / f"node{r // 2}" / "step-00000005")
        assert res["restored"]
    assert (run.mem / "node1" / "step-00000005" / "__2_0.distcp").exists()
    _wipe(run.mem / "node0")
    _wipe(run.mem / "node1")
    back = run("restart")
    for res in back:
        assert res["found"]["step"] == 3 and res["found"]["level"] == 1, res["found"]


@pytest.mark.slow(reason="three simulated nodes of gloo processes, run three times (one lost, two lost)")
def test_three_nodes_one_lost_restores_from_the_next_node_two_adjacent_lost_fall_to_disk(run):
    """6 ranks as 3 nodes (an odd count: a ring, not pairs), replicas=1. Node 1 wiped: step 5 from
    node 2's replica. Then nodes 1 and 2 wiped (node 1's only replica was on node 2): the disk
    level's step 3, never a step some rank cannot load."""
    results = run("replicate", world=6, steps=5, timeout=300)
    assert all(res["stats"]["steps"] == 5 for res in results), [res["stats"] for res in results]
    assert any(p.startswith("replicas/node-0000/step-00000005/") for p in results[2]["tree"])  # node 1 holds node 0
    assert any(p.startswith("replicas/node-0001/step-00000005/") for p in results[4]["tree"])  # node 2 holds node 1
    _wipe(run.mem / "node1")
    back = run("restart", world=6, timeout=300)
    assert [res["found"]["step"] for res in back] == [5] * 6
    assert [res["found"]["level"] for res in back] == [0] * 6
    _wipe(run.mem / "node1")
    _wipe(run.mem / "node2")
    back = run("restart", world=6, timeout=300)
    assert [(res["found"]["step"], res["found"]["level"]) for res in back] == [(3, 1)] * 6


def test_a_flipped_byte_in_a_replica_is_skipped_with_a_warning_and_the_older_replica_used(run, replicated):
    """Node 1 wiped; in node 0's replica of node 1's step 5 one byte of rank 3's file flipped: that
    step is not restored (its CRC32 is not the primary's), warned; step 4 (the older replica) is
    agreed on every rank and loads exactly."""
    run.start_from(replicated)
    _flip_byte(run.mem / "node0" / "replicas" / "node-0001" / "step-00000005" / "__3_0.distcp")
    _wipe(run.mem / "node1")
    back = run("restart")
    assert [res["found"]["step"] for res in back] == [4] * 4
    said = [w for w in back[3]["warnings"] if "replica of step 5" in w]
    assert said and "CRC32" in said[0], back[3]["warnings"]
    assert not (run.mem / "node1" / "step-00000005").exists()


def test_enospc_in_a_partners_memory_leaves_the_local_copy_and_warns_once(run):
    """Rank 2's replica memory is full: rank 0's steps are recorded as not replicated with
    ReplicationError(errno=ENOSPC, partner=2), one ReplicationWarning on rank 0; the local
    copies and every other link stand, training goes on."""
    results = run("replicate_enospc", steps=4, full_rank=2)
    r0 = results[0]
    assert sorted(int(s) for s in r0["stats"]["not_replicated"]) == [1, 2, 3, 4], r0["stats"]
    assert all(e[0] == errno.ENOSPC and e[1] == 2 for e in r0["stats"]["not_replicated"].values())
    warned = [w for w in r0["warnings"] if w.startswith("ReplicationWarning")]
    assert len(warned) == 1 and "rank 2" in warned[0], r0["warnings"]
    assert all(done == [0] or done == [0, 1] for done in r0["levels_done"].values())
    for r in (1, 2, 3):
        assert results[r]["stats"]["steps"] == 4 and not results[r]["stats"]["not_replicated"], results[r]["stats"]
    assert not any(p.startswith("replicas/node-0000/") and "__0_0" in p for p in results[2]["tree"])


def test_a_node_killed_while_replicas_are_in_flight_ends_the_survivors_and_no_half_replica_is_chosen(run):
    """Node 1's two ranks SIGKILL themselves while receiving the replica of step 3: ranks 0 and 1
    stop with a typed error in bounded time. A fresh job with node 1 replaced (empty memory)
    agrees on a step every rank loads exactly; a half replica is never restored."""
    results = run("replicate_kill", expect_dead=(2, 3), kill_node=1, kill_step=3, timeout=240)
    for res in results[:2]:
        assert res["stopped_by"], res
    _wipe(run.mem / "node1")
    back = run("restart")
    steps = {res["found"]["step"] for res in back}
    assert len(steps) == 1 and steps <= {1, 2, 3}, back
    assert all(res["restored"] for res in back)


def test_a_sender_killed_between_the_files_of_its_part_leaves_a_half_part_that_is_never_restored(run):
    """The window forced: rank 2 dies after its rank file of step 4 reached node 0 under its final
    name, before the rest of its part and the index. With node 1 replaced, the restart must not take
    that half part for step 4: node 1 gets step 3 back from node 0's memory (level 0), whole."""
    results = run("replicate_kill_sending", expect_dead=(2,), kill_step=4, timeout=240)
    assert all(res["stopped_by"] for i, res in enumerate(results) if i != 2), results
    half = [p for p in run.mem.glob("node0/replicas/*1/*4") if p.is_dir()]
    assert half and any(f.name.endswith(".distcp") for f in half[0].iterdir()), half  # a file under its name
    assert not any(f.name.startswith(".lazyckpt-replica-from-2") for f in half[0].iterdir())  # no index
    _wipe(run.mem / "node1")
    back = run("restart")
    assert [(res["found"]["step"], res["found"]["level"]) for res in back] == [(3, 0)] * 4, back
    assert all(res["restored"] for res in back)


def test_replicas_where_no_peer_can_hold_them_are_refused_when_the_saver_is_built(tmp_path):
    """``replicas`` needs a node-local level of a DistributedCheckpointer with k+1 nodes: refused
    (ValueError) on one process's savers, on a URL, below 0; a 1-rank job (one node) refused at
    construction, nothing left running."""
    import threading

    import lazyckpt
    from lazyckpt import Level

    with pytest.raises(ValueError, match="replicas"):
        Level(tmp_path / "m", replicas=-1)
    with pytest.raises(ValueError, match="URL"):
        Level("s3://bucket/run", replicas=1)
    with pytest.raises(ValueError, match="replicas=1 needs torch.distributed"):
        lazyckpt.LazyCheckpointer(levels=[Level(tmp_path / "m", replicas=1)])
    before = set(threading.enumerate())
    with _launch.one_rank_group():
        from lazyckpt.distributed import DistributedCheckpointer

        with pytest.raises(ValueError, match="needs a node-local level|at least 2 nodes"):
            DistributedCheckpointer(levels=[Level(tmp_path / "m", replicas=1)])
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("lazyckpt") and t.is_alive()]


def test_a_fresh_checkpointer_restores_the_wiped_node_in_its_own_latest(run, replicated):
    """The restart asks ``DistributedCheckpointer.latest()`` first (its own replication group):
    node 1 wiped, step 5 agreed and loaded exactly on every rank."""
    run.start_from(replicated)
    _wipe(run.mem / "node1")
    back = run("restart_checkpointer_first")
    assert [(res["found"]["step"], res["found"]["level"]) for res in back] == [(5, 0)] * 4
    assert all(res["restored"] for res in back)


def test_a_primary_corrupted_after_its_commit_is_not_replicated(run):
    """Rank 0's memory file of step 2 changes after its commit: its partner (rank 2) checks the bytes
    against the CRC32 rank 0 wrote, refuses them and says so; step 2 is recorded as not replicated
    on rank 0 (one warning), every other step and link replicates."""
    results = run("replicate_corrupt_source", steps=4)
    r0 = results[0]
    assert list(r0["stats"]["not_replicated"]) == ["2"], r0["stats"]
    assert "did not match the primary's CRC32" in r0["stats"]["not_replicated"]["2"][2]
    assert r0["stats"]["steps"] == 3
    assert [w for w in r0["warnings"] if w.startswith("ReplicationWarning")], r0["warnings"]
    assert all(res["stats"]["steps"] == 4 for res in results[1:]), [res["stats"] for res in results]
    assert not any("node-0000/step-00000002/__0_0.distcp" in p for p in results[2]["tree"]), results[2]["tree"]


@pytest.mark.slow(reason="gloo processes wait out one replication timeout")
def test_a_partner_whose_replication_is_dead_costs_one_timeout_and_a_warning_training_goes_on(run):
    """Rank 2 trains but its replicator takes no part: rank 0 (which sends to and receives from it)
    fails its first round at the replication group's timeout (10 s here), then records every step
    as not replicated without waiting again, warned once; all steps commit on every level; ranks 1
    and 3 replicate every step."""
    results = run("replicate_partner_silent", steps=4, silent_rank=2, commit_timeout=10)
    r0 = results[0]
    assert sorted(int(s) for s in r0["stats"]["not_replicated"]) == [1, 2, 3, 4], r0["stats"]
    assert all(e[1] == 2 for e in r0["stats"]["not_replicated"].values())
    assert len([w for w in r0["warnings"] if w.startswith("ReplicationWarning")]) == 1, r0["warnings"]
    assert r0["rounds_with_silent"] == 1, r0  # the broken pair is never used again (4 without that)
    assert all(done in ([0], [0, 1]) for done in r0["levels_done"].values()), r0["levels_done"]
    for r in (1, 3):
        assert results[r]["stats"]["steps"] == 4 and not results[r]["stats"]["not_replicated"], results[r]["stats"]


def test_the_memory_statement_counts_the_replicas_a_node_holds(mem, monkeypatch):
    """A replicated memory level holds keep x (1 + k) checkpoints plus its queued ones: the first
    save's statement counts them (here 2 x 2 + 2 of 100 KB: above half of a 1 MB 'RAM', where the
    same level without replicas, 2 x 100 KB, is not)."""
    import warnings

    from lazyckpt import Level, MemoryLevelWarning
    from lazyckpt.schedule import _copy

    monkeypatch.setattr(_copy, "memory_total", lambda: 1 << 20)
    os.makedirs(mem)  # a tmpfs folder: only memory filesystems are counted
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _copy.check_memory((Level(mem, keep=2),), 100_000)
    with pytest.warns(MemoryLevelWarning, match=r"keep=2 x \(1 \+ 1 replicas\) \+ 2 backlog"):
        _copy.check_memory((Level(mem, keep=2, replicas=1),), 100_000)
