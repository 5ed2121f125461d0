"""2 processes on one node (gloo, CPU), save_state by level; run under ``accelerate launch``.

mp_levels.py train MEM DISK OUT: 4 steps, a bare save_state after each (memory every step, disk every 2);
    at step 2 process 1 is held inside its save_state (before it has written anything) until process 0
    has looked: the step's handle must not be done and the disk level must not hold the step yet,
    since process 1's part is missing. Writes OUT/expected_rank<r>.pt (state at step 4) and
    OUT/summary.json.
mp_levels.py restore MEM DISK OUT: a fresh accelerator (other weights) on each process, load_latest;
    OUT/restored.json: {rank: [found.step, found.level, every state equal to step 4's]}.
mp_levels.py ahead MEM DISK OUT: process 1 writes step 2 before the main process's save of it has begun,
    while the main process's retention of step 1 runs (forced; see ``ahead``). OUT/summary.json.
mp_levels.py main_fails MEM DISK OUT: the main process's save of step 2 raises after the processes agreed
    on it, training goes on (see ``main_fails``). OUT/summary.json.
mp_levels.py load_right_after MEM DISK OUT: load_state(<step 2's folder>) right after save_state() on
    both processes, the main process's marker still there (see ``load_right_after``). OUT/summary.json.
"""

import json
import os
import random
import sys
import time

import acc_common as C  # this script's folder is first on the path
import numpy as np
import torch
import torch.distributed as dist
from accelerate import Accelerator

import lazyckpt.accelerate
from _util import run_then_exit
from lazyckpt import Level

MODEL = dict(C.MP_MODEL, dim=512)  # model.safetensors ~2 MiB, optimizer.bin ~4 MiB: above the page-reuse bar (1 MiB)


def setup(seed):
    acc = Accelerator(cpu=True)
    assert acc.num_processes == 2, acc.num_processes
    model, opt, sched = acc.prepare(*C.build(seed, **MODEL))
    rank = acc.process_index
    torch.manual_seed(10 + rank)  # every process has its own RNG streams, so each RNG file differs
    random.seed(10 + rank)
    np.random.seed(10 + rank)
    return acc, model, opt, sched


def held_until_process_0_looked(acc):
    """Process 1's get_state_dict (the first thing stock save_state does after making the folder) waits
    for process 0's look at the window (a barrier process 0 enters after it), once."""
    real = acc.get_state_dict

    def held(*args, **kwargs):
        acc.get_state_dict = real
        dist.barrier()
        return real(*args, **kwargs)

    acc.get_state_dict = held


def train(mem, disk, out):
    acc, model, opt, sched = setup(0)
    rank = acc.process_index
    h = lazyckpt.accelerate.install(
        acc, levels=[Level(mem, every=1, keep=2, reuse_pages=True), Level(disk, every=2, keep=2)]
    )
    gen = torch.Generator().manual_seed(100 + rank)  # every process has its own data
    window = None
    for _ in range(4):
        C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])
        if h.step == 2 and rank == 1:
            held_until_process_0_looked(acc)
        snap = C.snapshot(acc, [model], [opt], [sched])
        acc.save_state()
        if h.step == 3:
            h.wait()  # step 3 complete, so step 1's folder is dropped (and its large files parked) before step 4
        if h.step == 2 and rank == 0:
            try:
                h.last_save.exception(timeout=3.0)  # confirms this process's part; it must not be enough
                done = True
            except TimeoutError:
                done = False
            window = {"handle_done": done, "disk_step": os.path.exists(os.path.join(disk, "step-00000002"))}
            dist.barrier()  # process 1 goes on
    torch.save(snap, os.path.join(out, f"expected_rank{rank}.pt"))
    C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])  # training moves on at once
    h.wait()
    reused = h.checkpointer._engine.spares.reused  # step 4's files written over step 1's pages (main process)
    h.uninstall()
    if rank == 0:
        with open(os.path.join(out, "summary.json"), "w") as fh:
            json.dump({"window": window, "reused": reused}, fh)
    acc.wait_for_everyone()


def ahead(mem, disk, out):
    """Process 1 writes step 2 into its folder before the main process's save of it has begun: the
    main process's retention of step 1 (on its watcher thread, held until process 1's step-2 RNG
    file is there) runs in that window (its training thread holds its step-2 save until step 1's
    handle is done). The step-2 folder must not be taken for one an earlier run left (it was:
    removed as "after step 1, where this run started", and step 2 failed at ``load_timeout``)."""
    from lazyckpt.accelerate import _levels
    from lazyckpt.schedule import _multi

    acc, model, opt, sched = setup(0)
    rank = acc.process_index
    step2 = os.path.join(mem, "step-00000002")
    if rank == 0:
        real_gathered, real_save_with = _levels.LevelSaves._gathered, _multi.MultiLevel.save_with
        held = {}

        def gathered(self, call, gather):
            if call.folder and call.folder.endswith("step-00000001"):
                deadline = time.monotonic() + 60
                while not os.path.exists(os.path.join(step2, "random_states_1.pkl")):  # process 1 is there
                    assert time.monotonic() < deadline, "process 1 never wrote step 2"
                    time.sleep(0.01)
                held["seen"] = sorted(os.listdir(step2))
            return real_gathered(self, call, gather)

        def save_with(self, step, produce, *args, **kwargs):
            if step == 2:
                held["step1"] = repr(h.last_save.exception(timeout=60))  # step 1 committed: its retention ran
            return real_save_with(self, step, produce, *args, **kwargs)

        _levels.LevelSaves._gathered, _multi.MultiLevel.save_with = gathered, save_with
    h = lazyckpt.accelerate.install(acc, levels=[Level(mem, every=1, keep=2)], load_timeout=20)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])
        acc.save_state()
    t0 = time.monotonic()
    error = h.last_save.exception(timeout=60)
    summary = {"step2": repr(error), "wait_s": round(time.monotonic() - t0, 1)}
    h.uninstall()
    if rank == 0:
        summary.update(held, files=sorted(os.listdir(step2)), steps=sorted(os.listdir(mem)))
        with open(os.path.join(out, "summary.json"), "w") as fh:
            json.dump(summary, fh)
    acc.wait_for_everyone()


def main_fails(mem, disk, out):
    """The main process's save of step 2 raises after the processes agreed on the step (forced: as
    ``save_with`` raises an earlier save's error), and training goes on (the caller caught it); process
    1 wrote its part of step 2. Step 2's folder must stay incomplete (the main process's marker), so
    that after step 3 ``keep=2`` keeps steps 1 and 3, not step 2 (only process 1's RNG file in it)
    and step 3. OUT/summary.json (main process)."""
    from lazyckpt.commit.folder import is_complete
    from lazyckpt.schedule import _multi

    acc, model, opt, sched = setup(0)
    rank = acc.process_index
    raised = []
    if rank == 0:
        real_save_with = _multi.MultiLevel.save_with

        def save_with(self, step, produce, *args, **kwargs):
            if step == 2:
                raise RuntimeError("forced: an earlier save's error, raised by save_with")
            return real_save_with(self, step, produce, *args, **kwargs)

        _multi.MultiLevel.save_with = save_with
    h = lazyckpt.accelerate.install(acc, levels=[Level(mem, every=1, keep=2)], load_timeout=20)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(3):
        C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])
        try:
            acc.save_state()
        except RuntimeError as exc:
            raised.append([h.step, str(exc)])
        h.last_save.exception(timeout=60)  # this process's part of the step (the main process: the folder)
    if rank == 0:
        folders = {n: is_complete(os.path.join(mem, n)) for n in sorted(os.listdir(mem)) if n.startswith("step-")}
        step2 = os.path.join(mem, "step-00000002")
        files = sorted(os.listdir(step2)) if os.path.isdir(step2) else None
    errors = []
    try:
        h.wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        errors.append(repr(exc))
    h.uninstall()
    if rank == 0:
        with open(os.path.join(out, "summary.json"), "w") as fh:
            json.dump({"raised": raised, "folders": folders, "step2": files, "errors": errors}, fh)
    acc.wait_for_everyone()


def load_right_after(mem, disk, out):
    """Every process calls ``load_state(<step 2's folder>)`` right after ``save_state()``, the main
    process's watcher (which ends its marker in the folder) held until the main process's
    ``load_state`` has waited for its own save (``settle_folder``) or, without that wait, has decided
    (``folder_to_load``'s end): the folder must load, never be "incomplete" for the main process's own
    marker. OUT/summary.json (main process)."""
    import threading

    from lazyckpt.accelerate import _levels, _load

    acc, model, opt, sched = setup(0)
    rank = acc.process_index
    step2 = os.path.join(mem, "step-00000002")
    if rank == 0:
        entered = threading.Event()
        real_gathered, real_to_load = _levels.LevelSaves._gathered, _load.folder_to_load

        def gathered(self, call, gather):
            if call.folder and call.folder.endswith("step-00000002"):
                assert entered.wait(60), "load_state never came"
            return real_gathered(self, call, gather)

        def to_load(*args, **kwargs):
            try:
                return real_to_load(*args, **kwargs)
            finally:
                entered.set()

        _levels.LevelSaves._gathered, _load.folder_to_load = gathered, to_load
        real_settle = getattr(_levels.LevelSaves, "settle_folder", None)
        if real_settle is not None:

            def settle(self, folder, timeout):
                entered.set()
                return real_settle(self, folder, timeout)

            _levels.LevelSaves.settle_folder = settle
    h = lazyckpt.accelerate.install(acc, levels=[Level(mem, every=1, keep=2)], load_timeout=20)
    gen = torch.Generator().manual_seed(100 + rank)
    for _ in range(2):
        C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])
        acc.save_state()
    try:
        acc.load_state(step2)
        loaded = "ok"
    except Exception as exc:  # noqa: BLE001 - reported to the test
        loaded = f"{type(exc).__name__}: {exc}"
    try:
        h.wait()
    except Exception as exc:  # noqa: BLE001 - reported to the test
        loaded += f"; wait: {exc!r}"
    h.uninstall()
    results = [None, None]
    dist.all_gather_object(results, loaded)
    if rank == 0:
        with open(os.path.join(out, "summary.json"), "w") as fh:
            json.dump({"loaded": results}, fh)
    acc.wait_for_everyone()


def restore(mem, disk, out):
    acc, model, opt, sched = setup(1234)
    rank = acc.process_index
    h = lazyckpt.accelerate.install(acc, levels=[Level(mem, every=1, keep=2), Level(disk, every=2, keep=2)])
    found = lazyckpt.accelerate.load_latest(acc)
    got = C.snapshot(acc, [model], [opt], [sched])
    mine = torch.load(os.path.join(out, f"expected_rank{rank}.pt"), weights_only=False)
    main = torch.load(os.path.join(out, "expected_rank0.pt"), weights_only=False)
    ok = h.step == found.step
    try:
        C.assert_same(got["models"], main["models"], "models (the main process's file)")
        for k in ("opts", "scheds", "step", "torch_rng", "np_rng"):
            C.assert_same(got[k], mine[k], k)
        assert got["py_rng"] == mine["py_rng"]
    except AssertionError as exc:
        print(f"rank {rank}: {exc}", file=sys.stderr)
        ok = False
    h.uninstall()
    results = [None, None]
    dist.all_gather_object(results, [found.step, found.level, ok])
    if rank == 0:
        with open(os.path.join(out, "restored.json"), "w") as fh:
            json.dump({str(r): v for r, v in enumerate(results)}, fh)
    acc.wait_for_everyone()


if __name__ == "__main__":
    scenario, mem, disk, out = sys.argv[1:5]
    # no interpreter finalization: a gloo thread may abort it
    scenarios = {
        "train": train, "restore": restore, "ahead": ahead, "main_fails": main_fails,
        "load_right_after": load_right_after,
    }  # fmt: skip
    run_then_exit(lambda: scenarios[scenario](mem, disk, out))
