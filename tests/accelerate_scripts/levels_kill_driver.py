"""Accelerate training with multi-level save_state, SIGKILLed at forced points (or random ones),
restarted with load_latest.

Usage: levels_kill_driver.py MEM_DIR DISK_DIR EXPECT_DIR RESULTS POINTS SEED

The fork / SIGKILL / restart loop is the core's (``levels_scripts/kill_driver.py``, same arguments):
it forks a training child per kill point (each SIGKILLs itself at its point: halfway through a write
of a memory-level file, halfway through the disk level's copy, between a rename and its folder's
fsync), or KILLS times killed after a random delay counted from its first complete step (so every run gets
somewhere however loaded the machine), then a last child that only checks; here the child is an Accelerate
training. Each child first checks what its predecessor left: ``load_latest``
must restore the newest step that some level holds as a folder that looks complete to stock readers
(no pending marker, every stock file there, each read by safetensors / torch.load and equal to the
state recorded for that step), and the state it restores must be that step's; then it trains on from there with a bare
``save_state()`` after every step. The state at a step is deterministic (the data is seeded by the
step), and its digest is written to EXPECT_DIR/<step> BEFORE ``save_state``, so every folder that can
exist complete has its expected digest. Every third restart first wipes the memory level (a reboot),
so restarts come from the disk level too. Each check appends one JSON line to RESULTS.
"""

from __future__ import annotations

import hashlib
import os
import shutil

import torch
from accelerate import Accelerator
from safetensors.torch import load_file

import lazyckpt.accelerate
from lazyckpt import Level
from lazyckpt.commit.folder import pending_markers
from levels_scripts import kill_driver as K  # parses the same arguments; its _flat, record and loop

mem, disk, expect_dir, results = K.mem, K.disk, K.expect_dir, K.results
LEVELS = [Level(mem, every=1, keep=2), Level(disk, every=3, keep=2)]
FILES = ("model.safetensors", "optimizer.bin", "random_states_0.pkl")


def digest(model_sd: dict, opt_sd: dict) -> str:
    h = hashlib.sha256()
    for key, value in K._flat({"model": model_sd, "opt": opt_sd}):
        h.update(key.encode())
        h.update(value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if torch.is_tensor(value)
                 else repr(value).encode())  # fmt: skip
    return h.hexdigest()


def expected(step: int) -> str:
    with open(os.path.join(expect_dir, str(step))) as fh:
        return fh.read()


def newest_complete() -> int | None:
    """The newest step some level holds as a folder stock readers read whole (each must match)."""
    best = None
    for level in LEVELS:
        for name in sorted(os.listdir(level.path)) if os.path.isdir(level.path) else []:
            folder = os.path.join(level.path, name)
            if not name.startswith("step-") or pending_markers(folder):
                continue
            try:
                if not all(os.path.exists(os.path.join(folder, f)) for f in FILES):
                    continue  # a folder being created (stock makes it before the marker exists)
                got = digest(load_file(os.path.join(folder, "model.safetensors")),
                             torch.load(os.path.join(folder, "optimizer.bin"), weights_only=False))  # fmt: skip
            except FileNotFoundError:
                continue  # removed by retention meanwhile (this is a reader racing nothing: the writer is dead)
            step = int(name[5:])
            if got != expected(step):
                raise AssertionError(f"{folder} does not hold the state of step {step}")
            best = step if best is None else max(best, step)
    return best


def build():
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def restarts() -> int:
    """The checks so far (RESULTS' lines that are not a kill point's)."""
    try:
        with open(results) as fh:
            return sum(1 for line in fh if '"point"' not in line)
    except FileNotFoundError:
        return 0


def check():
    if restarts() % 3 == 2:
        shutil.rmtree(mem, ignore_errors=True)  # a reboot before this restart: node memory is gone
    acc, model, opt = build()
    handle = lazyckpt.accelerate.install(acc, levels=LEVELS)
    want = newest_complete()
    found = lazyckpt.accelerate.load_latest(acc)
    entry = {"pid": os.getpid(), "want": want, "found": None if found is None else [found.step, found.level]}
    if found is not None:
        entry["same"] = digest(acc.unwrap_model(model).state_dict(), opt.state_dict()) == expected(found.step)
        entry["step"] = handle.step
    entry["ok"] = (found is None and want is None) or (
        found is not None and found.step == want and entry["same"] and entry["step"] == found.step
    )
    K.record(entry)
    return acc, model, opt, handle


def train(checked: int, point: str | None, nth: int) -> None:
    acc, model, opt, handle = check()
    if point is not None:
        K.arm(point, nth)
        os.write(checked, b"1")  # the driver waits for the child to kill itself at the point (K.main)
    first = point is None
    while True:
        step = handle.step
        gen = torch.Generator().manual_seed(step)
        loss = model(torch.randn(8, 256, generator=gen)).square().mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        assert handle.step == step + 1
        tmp = os.path.join(expect_dir, f".{step + 1}.tmp")
        with open(tmp, "w") as fh:
            fh.write(digest(acc.unwrap_model(model).state_dict(), opt.state_dict()))
        os.replace(tmp, os.path.join(expect_dir, str(step + 1)))
        acc.save_state()  # training goes on at once: the next step changes the state
        if first:  # a random kill: its timer starts once this run holds one complete step, so every run
            handle.wait()  # gets somewhere however slow the machine is (a kill may still hit any later save)
            os.write(checked, b"1")
            first = False


if __name__ == "__main__":
    import accelerate.checkpointing  # noqa: F401 - warm here, never in a child
    import safetensors.torch  # noqa: F401

    K.check, K.train = check, train  # type: ignore[assignment]
    K.main()
