"""Lightning fits with MultiLevelCheckpoint SIGKILLed at random points, resumed from ``latest()``.

Usage: levels_kill.py MEM_DIR DISK_DIR EXPECT_DIR RESULTS KILLS SEED STEPS  (tests/ and the repository
root on PYTHONPATH)

The pattern of tests/levels_scripts/kill_driver.py with a real Trainer: the driver imports torch and
Lightning once and forks every run. First a reference child trains STEPS steps uninterrupted without
lazyckpt (stock plugin) and writes the digest of the state ``trainer.save_checkpoint`` would write at
each step (weights, optimizers, schedulers, loops) to EXPECT_DIR/<step>, and the final one to
EXPECT_DIR/final. Then KILLS times a child checks what its predecessors left, resumes with stock
``trainer.fit(model, ckpt_path=latest(levels).path)`` and trains, until SIGKILLed after a random delay
(anywhere: Trainer setup, a save, a copy, a retention, teardown); after every 4th kill the memory
level is wiped too (a reboot: the next run resumes from the disk level). Check: ``latest()`` is the newest
step that some level holds as a file stock ``torch.load`` reads, every such file holds the reference
state of its step, ``lazyckpt.load(latest)`` too. A last child checks, then trains to STEPS unkilled;
its final weights, optimizer and scheduler states must be the reference's. One JSON line per check
in RESULTS. The run is one epoch (resuming from an epoch's last batch: tests/test_lightning_levels.py).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import time
import traceback
from typing import Any

import torch

mem, disk, expect_dir, results, kills, seed, steps = sys.argv[1:8]
STEPS = int(steps)
FINAL = ("state_dict", "optimizer_states", "lr_schedulers", "global_step")  # after fit (the loops end it)


def record(entry: dict[str, Any]) -> None:
    with open(results, "a") as fh:
        fh.write(json.dumps(entry) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


def expected(name: str | int) -> str:
    with open(os.path.join(expect_dir, str(name))) as fh:
        return fh.read()


def write_expected(name: str | int, value: str) -> None:
    tmp = os.path.join(expect_dir, f".{name}.tmp")
    with open(tmp, "w") as fh:
        fh.write(value)
    os.replace(tmp, os.path.join(expect_dir, str(name)))


def reference() -> None:
    import lightning as L

    from lightning_scripts.levels_gpt import StepGPT, digest, level_trainer, state_of

    class Expect(L.Callback):
        def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
            write_expected(trainer.global_step, digest(state_of(trainer)))

    torch.manual_seed(0)
    trainer = level_trainer([Expect()], [], max_steps=STEPS)
    trainer.fit(StepGPT(batches=STEPS + 1))
    write_expected("final", digest(state_of(trainer), FINAL))


def levels() -> list[Any]:
    from lazyckpt import Level

    return [Level(mem, every=1, keep=2), Level(disk, every=3, keep=2)]


def newest_readable() -> int | None:
    """The newest step some level holds as a file stock torch.load reads (each must match)."""
    from lightning_scripts.levels_gpt import digest

    best = None
    for level in levels():
        for name in os.listdir(level.path) if os.path.isdir(level.path) else []:
            if not (name.startswith("step-") and name.endswith(".pt")):
                continue
            step = int(name[5:-3])
            try:
                state = torch.load(os.path.join(level.path, name), weights_only=False)
            except FileNotFoundError:  # removed by retention meanwhile (no other process runs now)
                continue
            if digest(state) != expected(step):
                raise AssertionError(f"{level.path}/{name} does not hold the state of step {step}")
            best = step if best is None else max(best, step)
    return best


def check() -> str | None:
    import lazyckpt
    from lightning_scripts.levels_gpt import digest

    want = newest_readable()
    found = lazyckpt.latest(levels())
    entry: dict[str, Any] = {"pid": os.getpid(), "want": want}
    entry["found"] = None if found is None else [found.step, found.level]
    if found is not None:
        entry["same"] = digest(lazyckpt.load(found)) == expected(found.step)
    entry["ok"] = (found is None and want is None) or (found is not None and found.step == want and entry["same"])
    record(entry)
    return None if found is None else found.path


def train(final: bool) -> None:
    from lazyckpt.lightning import LazyCheckpointIO, MultiLevelCheckpoint
    from lightning_scripts.levels_gpt import StepGPT, digest, level_trainer, state_of

    path = check()
    torch.manual_seed(0)
    trainer = level_trainer([MultiLevelCheckpoint(levels())], [LazyCheckpointIO()], max_steps=STEPS)
    trainer.fit(StepGPT(batches=STEPS + 1), ckpt_path=path)
    if final:
        same = digest(state_of(trainer), FINAL) == expected("final")
        record({"final": True, "ok": same, "step": trainer.global_step})


def child(fn: Any, *args: Any) -> int:
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def main() -> None:
    rng = random.Random(int(seed))
    torch.set_num_threads(1)
    import lightning  # noqa: F401  (imported once, here: every child is forked with it)

    _, status = os.waitpid(child(reference), 0)
    assert status == 0, "the reference run failed"
    for i in range(int(kills)):
        pid = child(train, False)
        time.sleep(rng.uniform(0.4, 2.2))  # the kill point: anywhere in the child's run
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if i % 4 == 3:
            shutil.rmtree(mem, ignore_errors=True)  # now and then the node reboots: the memory level is gone
    _, status = os.waitpid(child(train, True), 0)
    assert status == 0, "the last run failed"


if __name__ == "__main__":
    main()
