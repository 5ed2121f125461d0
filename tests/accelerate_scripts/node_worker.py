"""One process of the Accelerate node-loss tests (CPU, gloo): processes stand for nodes, ``per_node`` (2)
of them per node (4 processes are 2 nodes, 6 are 3). Each process is given its node's own memory folder
``mem/node<rank // per_node>`` (node-local: the probe finds it shared by that node's processes only) and
the one shared ``disk`` folder:
``install(acc, levels=[Level(mem/node<g>, every=1, keep=2, replicas=1), Level(disk, every=2, keep=2)])``.

Usage: node_worker.py SCENARIO RANK WORLD PORT WORKDIR (``tests/_worker.py``); the run comes from the env
var LAZYCKPT_TEST_ACC_NODES (JSON: ``mem``, ``disk``, ``per_node``, ``steps``, ``replicas`` (default 1)).

train: ``steps`` optimizer steps, a bare ``save_state()`` after each on every process; before each save the
    process's state is snapshotted (``C.snapshot``: model, optimizer, scheduler, step, its own RNG streams)
    to WORKDIR/expected-<step>-rank<r>.pt, the reference of the restarts.
restart: fresh processes, a fresh model (other weights), ``load_latest(acc)`` on every process; the state
    compared exactly with the snapshots of the step found (model/optimizer/scheduler: the main process's;
    step and RNG: this process's own).
train_remote_fails: as train, 3 steps, but process 3 (node 1, the last: a gap in the RNG files
    would show) sends an error instead of its RNG file at
    step 3 (``Nodes.post`` patched): the main process's step-3 save fails naming it (RESULT["errors"]),
    its folder keeps the main process's marker of the gathering (incomplete), no copy is made.
refuse_shared / refuse_local_without_replicas: install with levels it must refuse (ValueError).
"""

from __future__ import annotations

import json
import os
import random
import time
import traceback
import warnings

import acc_common as C  # this script's folder is first on the path
import numpy as np
import torch

import _util
import _worker
import lazyckpt.accelerate
from lazyckpt import Level

ARGS = _worker.parse_argv()
SCENARIO, RANK, WORLD, PORT, WORKDIR = ARGS
RESULT: dict = {"ok": True}
CONFIG = json.loads(os.environ.get("LAZYCKPT_TEST_ACC_NODES", "{}"))
PER_NODE = CONFIG.get("per_node", 2)
MODEL = C.MP_MODEL


def node() -> int:
    return RANK // PER_NODE


def node_mem() -> str:
    return os.path.join(CONFIG["mem"], f"node{node()}")


def levels() -> list[Level]:
    return [
        Level(node_mem(), every=1, keep=2, replicas=CONFIG.get("replicas", 1)),
        Level(CONFIG["disk"], every=2, keep=2),
    ]


def setup(seed: int):
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(save_on_each_node=CONFIG.get("save_on_each_node", False))
    acc = Accelerator(cpu=True, project_config=project)
    assert acc.num_processes == WORLD, (acc.num_processes, WORLD)
    assert acc.process_index == RANK, (acc.process_index, RANK)
    model, opt, sched = acc.prepare(*C.build(seed, **MODEL))
    torch.manual_seed(10 + RANK)  # every process has its own RNG streams, so each RNG file differs
    random.seed(10 + RANK)
    np.random.seed(10 + RANK)
    return acc, model, opt, sched


def _ours(seen) -> list[str]:
    return [
        f"{w.category.__name__}: {w.message}"
        for w in seen
        if "lazyckpt" in str(w.message) or w.category.__module__.startswith("lazyckpt")
    ]


def scenario_train_remote_fails() -> None:
    from lazyckpt.accelerate import _nodes

    real = _nodes.Nodes.post

    def post(self, seq, staging, error):
        if RANK == 3 and seq == 3:
            error = OSError(28, "No space left on device (injected)")
        return real(self, seq, staging, error)

    _nodes.Nodes.post = post
    scenario_train()


def scenario_train_staged() -> None:
    """As train, recording what each process of another node had in its staging folder when it sent."""
    from lazyckpt.accelerate import _nodes

    real = _nodes.Nodes.post
    RESULT["staged"] = []

    def post(self, seq, staging, error):
        RESULT["staged"].append(sorted(n for n in os.listdir(staging) if not n.startswith(".")))
        return real(self, seq, staging, error)

    _nodes.Nodes.post = post
    scenario_train()


def scenario_train_node_killed() -> None:
    """Node 1 is lost at step 3 (both its processes SIGKILLed by the first of them to post its RNG
    file, before it does), with ``install(load_timeout=120)``: node 0's processes stop training with
    the error of their training's collective; the main process's step-3 save ends within seconds
    (its heartbeat wait), not at the load_timeout, and ``h.wait()`` raises it (RESULT)."""
    from lazyckpt.accelerate import _nodes

    pids = os.path.join(WORKDIR, "pids-node-1")
    if node() == 1:
        _util.register_node_pid(pids, RANK)  # before step 1's collectives: all there by step 3
        real = _nodes.Nodes.post

        def post(self, seq, staging, error):
            if seq == 3:
                _util.kill_node(pids)
            return real(self, seq, staging, error)

        _nodes.Nodes.post = post
    acc, model, opt, sched = setup(0)
    h = lazyckpt.accelerate.install(acc, levels=levels(), load_timeout=120)
    gen = torch.Generator().manual_seed(100 + RANK)
    phase = ""
    try:
        for _ in range(CONFIG["steps"]):
            phase = f"train {h.step + 1}"
            C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])
            snap = C.snapshot(acc, [model], [opt], [sched])
            phase = f"save_state {h.step}"
            acc.save_state()
            torch.save(snap, os.path.join(WORKDIR, f"expected-{h.step}-rank{RANK}.pt"))
    except Exception as exc:  # noqa: BLE001 - the training's collective fails once node 1 is gone, or the
        RESULT["train_error"] = f"{type(exc).__name__}: {exc}"  # next save_state reports the step-3 save's error
        RESULT["train_phase"] = phase  # where it was raised
        RESULT["train_trace"] = traceback.format_exc()
    t0 = time.monotonic()
    try:
        h.wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        RESULT["wait_error"] = f"{type(exc).__name__}: {exc}"
    RESULT["wait_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    h.uninstall()
    RESULT["uninstall_s"] = time.monotonic() - t0


def scenario_train() -> None:
    acc, model, opt, sched = setup(0)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        h = lazyckpt.accelerate.install(acc, levels=levels())
        gen = torch.Generator().manual_seed(100 + RANK)  # every process has its own data
        RESULT["saved"] = []
        for _ in range(CONFIG["steps"]):
            C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])
            snap = C.snapshot(acc, [model], [opt], [sched])
            acc.save_state()
            torch.save(snap, os.path.join(WORKDIR, f"expected-{h.step}-rank{RANK}.pt"))
            RESULT["saved"].append(h.step)
            # each step's copies made before the next save: none is skipped for being behind the backlog
            try:
                h.wait()
            except Exception as exc:  # noqa: BLE001 - reported to the test
                RESULT.setdefault("errors", []).append(f"{h.step}: {type(exc).__name__}: {exc}")
        C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])  # training moves on
        h.wait()
        h.uninstall()
    RESULT["warnings"] = _ours(seen)
    acc.wait_for_everyone()  # the main process hosts the store: it must not exit while the others use it


def scenario_restart() -> None:
    acc, model, opt, sched = setup(1234)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        h = lazyckpt.accelerate.install(acc, levels=levels())
        found = lazyckpt.accelerate.load_latest(acc)
        assert found is not None, "nothing found"
        RESULT["found"] = {"step": found.step, "level": found.level, "path": str(found.path)}
        RESULT["h_step"] = h.step
        got = C.snapshot(acc, [model], [opt], [sched])
        mine = torch.load(os.path.join(WORKDIR, f"expected-{found.step}-rank{RANK}.pt"), weights_only=False)
        main = torch.load(os.path.join(WORKDIR, f"expected-{found.step}-rank0.pt"), weights_only=False)
        C.assert_same(got["models"], main["models"], "models (the main process's state)")
        for k in ("opts", "scheds"):
            C.assert_same(got[k], main[k], k)
        for k in ("step", "torch_rng", "np_rng"):
            C.assert_same(got[k], mine[k], f"{k} (this process's own)")
        assert got["py_rng"] == mine["py_rng"], "py_rng (this process's own)"
        RESULT["restored"] = True
        h.uninstall()
    RESULT["warnings"] = _ours(seen)
    acc.wait_for_everyone()


def _refused(given: list[Level]) -> None:
    acc, *_ = setup(0)
    try:
        h = lazyckpt.accelerate.install(acc, levels=given)
    except ValueError as exc:
        RESULT["refused"] = str(exc)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        RESULT["other_error"] = f"{type(exc).__name__}: {exc}"
    else:
        RESULT["installed"] = True
        h.uninstall()
    acc.wait_for_everyone()  # no process is left inside a collective of install()


def scenario_refuse_shared() -> None:
    """``replicas=1`` on the level every process shares (the disk)."""
    _refused([Level(CONFIG["disk"], every=1, keep=2, replicas=1)])


def scenario_refuse_local_without_replicas() -> None:
    """A node-local level without replicas across several nodes: the other nodes could not resume from it."""
    _refused([Level(node_mem(), every=1, keep=2), Level(CONFIG["disk"], every=2, keep=2)])


def init() -> None:
    os.environ.update(
        RANK=str(RANK),
        WORLD_SIZE=str(WORLD),
        LOCAL_RANK=str(RANK % PER_NODE),
        LOCAL_WORLD_SIZE=str(PER_NODE),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=PORT,
    )
    os.makedirs(node_mem(), exist_ok=True)


if __name__ == "__main__":
    _worker.run(ARGS, globals(), RESULT, init)
