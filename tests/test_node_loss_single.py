"""Node loss when ONE rank writes (DDP: ``LazyCheckpointer(levels=)`` built on every rank, global
rank 0 saving; ``Level(replicas=1)`` on the node-local memory level): 4 gloo ranks as 2 nodes
(``per_node`` ranks share one /dev/shm folder). Every committed file is copied into the next node's
memory folder under its own name; at a restart ``latest()`` (collective) gives every node the
newest step some node holds, and every rank loads it exactly (``tests/distributed_scripts/single_worker.py``)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest

dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed unavailable", allow_module_level=True)

import _launch  # noqa: E402

WORKER = Path(__file__).resolve().parent / "distributed_scripts" / "single_worker.py"
pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")


@pytest.fixture
def run(tmp_path, monkeypatch, mem):
    config = {"mem": mem, "disk": str(tmp_path / "disk"), "per_node": 2, "steps": 5}

    def go(scenario: str, world: int = 4, expect_dead: tuple[int, ...] = (), **extra):
        """``world`` ranks, ``per_node`` (2) of them per node: 4 ranks are 2 nodes, 6 are 3."""
        monkeypatch.setenv("LAZYCKPT_TEST_SINGLE", json.dumps({**config, **extra}))
        results = _launch.launch(WORKER, scenario, world, tmp_path, timeout=180, expect_dead=expect_dead)
        for r, res in enumerate(results):
            assert r in expect_dead or res["ok"], f"rank {r}: {res.get('traceback') or res.get('error')}"
        return results

    go.mem = Path(mem)  # type: ignore[attr-defined]
    go.disk = Path(config["disk"])  # type: ignore[attr-defined]
    return go


def _steps(folder: Path) -> list[int]:
    return sorted(int(n[5:13]) for n in os.listdir(folder) if n.startswith("step-") and n.endswith(".pt"))


def _wipe(folder: Path) -> None:
    shutil.rmtree(folder)
    folder.mkdir()  # a replaced node: the folder is there, empty


def test_rank_zeros_files_reach_the_next_node_and_a_wiped_node_gets_them_back(run):
    """Rank 0 saves 5 steps: node 1's folder holds steps 4 and 5 too (keep=2), whole; another
    rank's save is refused. Node 0 wiped: every rank agrees on step 5 from its own node's folder
    (node 0's got it back from node 1) and loads it exactly. Both wiped: step 3 from disk."""
    results = run("train")
    assert results[0]["stats"]["steps"] == 5 and not results[0]["stats"]["not_replicated"], results[0]
    assert results[2]["stats"]["received"] == results[0]["stats"]["sent"] > 0
    assert all("global rank 0 alone saves" in res["refused"] for res in results[1:])
    assert not any(res["warnings"] for res in results), [res["warnings"] for res in results]
    assert _steps(run.mem / "node0") == _steps(run.mem / "node1") == [4, 5]
    assert not [n for n in os.listdir(run.mem / "node1") if n.endswith(".tmp")]
    _wipe(run.mem / "node0")
    back = run("restart")
    for r, res in enumerate(back):
        assert res["found"] == {"step": 5, "level": 0, "path": str(run.mem / f"node{r // 2}" / "step-00000005.pt")}
        assert res["restored"]
        assert res["storage_reads"] == 1, res  # node 1's first rank: its restore check was its latest()'s read;
        # node 0's: the check of the copy it received
    _wipe(run.mem / "node0")
    _wipe(run.mem / "node1")
    back = run("restart")
    assert [(res["found"]["step"], res["found"]["level"]) for res in back] == [(3, 1)] * 4, back


@pytest.mark.slow(reason="three simulated nodes of gloo processes, saved, two wiped, restored")
def test_three_nodes_with_two_replicas_two_nodes_lost_come_back_from_the_third(run):
    """6 ranks as 3 nodes, ``replicas=2``: rank 0's steps are held by both other nodes (each its
    own copy, received once). Nodes 0 and 1 wiped: node 2 sends step 5 back to both, every rank
    loads it exactly from its own node's folder."""
    results = run("train", world=6, replicas=2)
    stats = results[0]["stats"]
    assert stats["steps"] == 5 and not stats["not_replicated"], stats
    assert results[2]["stats"]["received"] == results[4]["stats"]["received"] == stats["sent"] // 2 > 0
    assert not any(res["warnings"] for res in results), [res["warnings"] for res in results]
    assert _steps(run.mem / "node0") == _steps(run.mem / "node1") == _steps(run.mem / "node2") == [4, 5]
    _wipe(run.mem / "node0")
    _wipe(run.mem / "node1")
    back = run("restart", world=6, replicas=2)
    for r, res in enumerate(back):
        assert res["found"] == {"step": 5, "level": 0, "path": str(run.mem / f"node{r // 2}" / "step-00000005.pt")}
        assert res["restored"] and not res["warnings"], res


def test_a_primary_corrupted_after_its_commit_is_refused_by_the_holder(run):
    """Rank 0's file of step 4 is damaged after its commit, before it is sent (forced): node 1
    refuses it (the zip's CRC32s are the primary's), step 4 is recorded as not replicated with one
    ReplicationWarning, and node 1 never holds a step-4 file; step 5 is replicated as usual."""
    results = run("train", corrupt_step=4)
    assert results[0]["stats"]["not_replicated"] == [4], results[0]["stats"]
    assert results[0]["stats"]["steps"] == 4
    assert [w for w in results[0]["warnings"] if w.startswith("ReplicationWarning")], results[0]["warnings"]
    assert _steps(run.mem / "node1") == [3, 5]


def test_the_writer_killed_while_sending_leaves_no_file_behind_and_the_restart_agrees(run):
    """Rank 0 dies as it starts sending step 4 (the holder had made its temporary file): the
    others stop with a typed error, node 1 holds steps 2 and 3 and no temporary file; with node 0
    replaced, every rank resumes from step 3, node 0's folder given it back from node 1."""
    results = run("train_kill", expect_dead=(0,), kill_step=4)
    assert all(res["stopped_by"] for res in results[1:]), results
    names = os.listdir(run.mem / "node1")
    assert _steps(run.mem / "node1") == [2, 3] and not [n for n in names if n.endswith(".tmp")], names
    _wipe(run.mem / "node0")
    back = run("restart")
    assert [(res["found"]["step"], res["found"]["level"]) for res in back] == [(3, 0)] * 4, back


def test_copies_behind_by_the_levels_backlog_skip_the_step_instead_of_waiting(run):
    """The sending held (forced) while rank 0 saves 5 steps: steps 1 and 2 wait (backlog=2: one in
    flight, one queued), 3, 4, 5 are recorded as not replicated at once (no save waits, memory stays
    bounded); once released, node 1 holds steps 1 and 2."""
    results = run("train_slow")
    assert results[0]["stats"]["not_replicated"] == [3, 4, 5], results[0]["stats"]
    assert results[0]["stats"]["steps"] == 2
    assert len([w for w in results[0]["warnings"] if w.startswith("ReplicationWarning")]) == 1
    assert _steps(run.mem / "node1") == [1, 2]


def test_a_dead_holder_leaves_every_local_copy_and_warns_once(run):
    """Node 1's holder is SIGKILLed before rank 0's first save: every step is still committed at
    both of rank 0's levels, each recorded as not replicated (naming the holder), one
    ReplicationWarning, and rank 0 never waits on the dead holder past the first failed round."""
    results = run("train_holder_dead", expect_dead=(2,))
    res = results[0]
    assert res["stats"] == {"steps": 0, "not_replicated": [1, 2, 3, 4, 5]}, res
    assert {partner for _, partner in res["errors"].values()} == {2}, res["errors"]
    assert len([w for w in res["warnings"] if w.startswith("ReplicationWarning")]) == 1, res["warnings"]
    assert _steps(run.mem / "node0") == [4, 5] and _steps(run.mem / "node1") == []
    assert max(res["seconds"][1:]) < 10, res["seconds"]  # the broken holder is not tried again


def test_enospc_in_the_holders_memory_is_a_typed_error_and_the_local_copy_stands(run):
    """Node 1's memory is full when step 3's copy arrives (forced): step 3 is recorded as not
    replicated with ReplicationError(errno=ENOSPC, partner=2), one ReplicationWarning; rank 0's
    copy of step 3 was committed; no temporary file is left on node 1; steps 4 and 5 reach it."""
    results = run("train_holder_full", full_step=3)
    stats = results[0]["stats"]
    assert stats["not_replicated"] == [3] and stats["errors"] == {"3": [errno.ENOSPC, 2]}, stats
    assert stats["steps"] == 4
    warned = [w for w in results[0]["warnings"] if w.startswith("ReplicationWarning")]
    assert len(warned) == 1 and "No space left" in warned[0], results[0]["warnings"]
    assert os.path.exists(os.path.join(run.disk, "step-00000003.pt"))  # the writer's own levels had it
    names = os.listdir(run.mem / "node1")
    assert _steps(run.mem / "node1") == [4, 5] and not [n for n in names if n.endswith(".tmp")], names


def test_a_holder_whose_store_vanishes_between_the_announcement_and_its_read_stops_at_once(tmp_path):
    """The writer (rank 0, the store's host) announces its last word and exits; the holder's receiver is
    between its wait for that key and its read of it, so the read fails on a closed connection. The receiver
    must end with ``bye`` set: ``close()`` then returns at once instead of waiting its timeout (60 s; CI
    met that wait). The window is forced: the store server is SIGKILLed inside the holder's read."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    from lazyckpt.cluster import _single

    port = _launch.free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", "import sys, time, torch.distributed as d; "
         f"s = d.TCPStore('127.0.0.1', {port}, 1, True, wait_for_workers=False); "
         "s.set('p/2/0', '{\"bye\": true}'); print('up', flush=True); time.sleep(600)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "up"
        client = dist.TCPStore("127.0.0.1", port, 1, False, timeout=__import__("datetime").timedelta(seconds=5))

        class KilledInsideRead:  # the clone the receiver uses: its read finds the server gone
            def __getattr__(self, name):
                return getattr(client, name)

            def get(self, key):
                server.send_signal(signal.SIGKILL)
                server.wait()
                return client.get(key)

        holder = object.__new__(_single.SingleWriter)
        holder.rank, holder.prefix, holder.timeout = 2, "p", 60.0
        holder.store = type("Store", (), {"clone": lambda self: KilledInsideRead()})()
        holder._bye, holder._stop = threading.Event(), threading.Event()
        holder._cond, holder._closed = threading.Condition(), False
        holder._thread = threading.Thread(target=holder._receive_loop, daemon=True)
        holder._thread.start()
        t0 = time.monotonic()
        holder.close()
        assert time.monotonic() - t0 < 10, "close() waited for a receiver that had died"
        assert holder._bye.is_set() and not holder._thread.is_alive()
    finally:
        server.kill()
        server.wait()
        server.stdout.close()
