"""Accelerate training with multi-level save_state, SIGKILLed at random points, restarted with load_latest.

Usage: levels_kill_driver.py MEM_DIR DISK_DIR EXPECT_DIR RESULTS KILLS SEED

The driver imports torch and accelerate once, then forks a training child KILLS times and SIGKILLs it
after a random delay (a crash anywhere in a save, a copy, a retention). Each child first checks what
its predecessor left: ``load_latest`` must restore the newest step that some level holds as a folder
that looks complete to stock readers (no pending marker, every stock file there, each read by
safetensors / torch.load and equal to the state recorded for that step), and the state it restores
must be that step's; then it trains on from there with a bare ``save_state()`` after every step. The
state at a step is deterministic (the data is seeded by the step), and its digest is written to
EXPECT_DIR/<step> BEFORE ``save_state``, so every folder that can exist complete has its expected
digest. After every third kill the memory level is wiped (a reboot), so restarts come from the disk
level too. A last child only checks. Each check appends one JSON line to RESULTS.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import signal
import sys
import time
import traceback

import torch
from accelerate import Accelerator
from safetensors.torch import load_file

import lazyckpt.accelerate
from lazyckpt import Level
from lazyckpt.commit.folder import pending_markers

mem, disk, expect_dir, results, kills, seed = sys.argv[1:7]
LEVELS = [Level(mem, every=1, keep=2), Level(disk, every=3, keep=2)]
FILES = ("model.safetensors", "optimizer.bin", "random_states_0.pkl")


def digest(model_sd: dict, opt_sd: dict) -> str:
    h = hashlib.sha256()
    for key, value in _flat({"model": model_sd, "opt": opt_sd}):
        h.update(key.encode())
        h.update(value.reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if torch.is_tensor(value)
                 else repr(value).encode())  # fmt: skip
    return h.hexdigest()


def _flat(obj: object, prefix: str = "") -> list:
    if isinstance(obj, dict):
        return [kv for k in sorted(obj, key=str) for kv in _flat(obj[k], f"{prefix}/{k}")]
    if isinstance(obj, (list, tuple)):
        return [kv for i, v in enumerate(obj) for kv in _flat(v, f"{prefix}/{i}")]
    return [(prefix, obj)]


def record(entry: dict) -> None:
    with open(results, "a") as fh:
        fh.write(json.dumps(entry) + "\n")
        fh.flush()
        os.fsync(fh.fileno())


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


def check():
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
    record(entry)
    return acc, model, opt, handle


def train() -> None:
    acc, model, opt, handle = check()
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


def main() -> None:
    rng = random.Random(int(seed))
    torch.set_num_threads(1)
    # Warm the lazy imports (AdamW's step, accelerate's pieces) once, here, never in a child.
    warm = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(warm.parameters())
    warm(torch.ones(1, 2)).sum().backward()
    opt.step()
    import accelerate.checkpointing  # noqa: F401
    import safetensors.torch  # noqa: F401

    for i in range(int(kills)):
        pid = os.fork()
        if pid == 0:
            try:
                train()
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        time.sleep(rng.uniform(0.5, 2.0))  # the kill point: anywhere in the child's run
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        if i % 3 == 1:
            shutil.rmtree(mem, ignore_errors=True)  # now and then a reboot: node memory is gone
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            check()
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    sys.exit(os.waitstatus_to_exitcode(status))


if __name__ == "__main__":
    main()
