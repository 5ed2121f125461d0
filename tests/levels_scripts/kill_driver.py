"""Multi-level saves SIGKILLed at forced points (or random ones), restarted from ``latest()``, checked each time.

Usage: kill_driver.py MEM_DIR DISK_DIR EXPECT_DIR RESULTS POINTS SEED

POINTS is a comma-separated list of kill points (tests/_killpoints.py), one training child each: the
child SIGKILLs itself the NTH time (NTH from SEED, 2-4) its saves reach that point (a forced window),
after writing a ``point`` line to RESULTS. Or POINTS is a number, KILLS: KILLS children SIGKILLed by the
driver after a random delay after their check (the opt-in soak: a crash at any moment).

The driver imports torch once, then forks the training children. Each child first checks what
its predecessor left: ``latest()`` must be the newest step that some level holds as a file that
stock ``torch.load`` reads, and ``load(latest)`` must hash to the state dumped for that step; then
it resumes from there and trains. The state at a step is deterministic (data seeded by the step),
and its hash is written to EXPECT_DIR/<step> BEFORE ``save()``, so every file that can exist at a
final name has its expected hash. A last child only checks. Each check appends one JSON line to RESULTS.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import select
import signal
import sys
import threading
import time
import traceback

import torch

import _killpoints
import lazyckpt
from lazyckpt import LazyCheckpointer, Level

mem, disk, expect_dir, results, points, seed = sys.argv[1:7]
LEVELS = [Level(mem, every=1, keep=2), Level(disk, every=3, keep=2)]


def arm(point: str, nth: int) -> None:
    """SIGKILL this process the ``nth`` time a save reaches ``point`` (tests/_killpoints.py), after a
    line in RESULTS."""
    _killpoints.arm(point, nth, lambda: record({"point": point, "nth": nth}), mem=mem, disk=disk)


def digest(state: dict) -> str:
    h = hashlib.sha256()
    for part in ("model", "opt"):
        for key, value in _flat(state[part]):
            h.update(key.encode())
            h.update(
                value.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()
                if torch.is_tensor(value)
                else repr(value).encode()
            )
    h.update(str(state["step"]).encode())
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


def newest_readable() -> int | None:
    """The newest step some level holds as a file stock torch.load reads (each must match)."""
    best = None
    for level in LEVELS:
        for name in os.listdir(level.path) if os.path.isdir(level.path) else []:
            if not (name.startswith("step-") and name.endswith(".pt")):
                continue
            step = int(name[5:-3])
            try:
                state = torch.load(os.path.join(level.path, name), weights_only=True)
            except FileNotFoundError:
                continue
            with open(os.path.join(expect_dir, str(step))) as fh:
                if digest(state) != fh.read():
                    raise AssertionError(f"{level.path}/{name} does not hold the state of step {step}")
            best = step if best is None else max(best, step)
    return best


def check() -> tuple[torch.nn.Module, torch.optim.Optimizer, int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.Linear(1024, 256))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    want = newest_readable()
    found = lazyckpt.latest(LEVELS)
    entry = {"pid": os.getpid(), "want": want, "found": None if found is None else [found.step, found.level]}
    start = 1
    if found is not None:
        state = lazyckpt.load(found)
        with open(os.path.join(expect_dir, str(found.step))) as fh:
            entry["same"] = digest(state) == fh.read()
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = found.step + 1
    entry["ok"] = (found is None and want is None) or (
        found is not None and found.step == want and entry.get("same", False)
    )
    record(entry)
    return model, opt, start


def train(checked: int, point: str | None, nth: int) -> None:
    model, opt, step = check()
    if point is not None:
        arm(point, nth)
    os.write(checked, b"1")  # the driver's kill timer starts now: every child checks before it dies
    with LazyCheckpointer(levels=LEVELS) as ckpt:
        while True:
            gen = torch.Generator().manual_seed(step)
            loss = model(torch.randn(8, 256, generator=gen)).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            state = {"model": model.state_dict(), "opt": opt.state_dict(), "step": step}
            tmp = os.path.join(expect_dir, f".{step}.tmp")
            with open(tmp, "w") as fh:
                fh.write(digest(state))
            os.replace(tmp, os.path.join(expect_dir, str(step)))
            ckpt.save(state, step=step)  # training goes on at once: the next step changes the state
            step += 1


def main() -> None:
    rng = random.Random(int(seed))
    torch.set_num_threads(1)
    # Warm torch's lazy imports (the first Adam and its step import for seconds) once, here.
    warm = torch.nn.Linear(2, 2)
    opt = torch.optim.Adam(warm.parameters())
    warm(torch.ones(1, 2)).sum().backward()
    opt.step()
    forced = [] if points.isdigit() else points.split(",")
    for i in range(len(forced) or int(points)):
        point = forced[i] if forced else None
        nth = rng.randint(2, 4)
        checked_r, checked_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                train(checked_w, point, nth)
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(1)
        os.close(checked_w)
        select.select([checked_r], [], [], 120)  # its check done (or it died: EOF), bounded
        os.close(checked_r)
        if point is None:
            time.sleep(rng.uniform(0.2, 0.9))  # the kill point: anywhere in the child's training and saves
            os.kill(pid, signal.SIGKILL)
        else:  # it kills itself at the point; bounded: a point never reached is killed and reported

            def not_reached(pid: int = pid, point: str = point, nth: int = nth) -> None:
                record({"point": point, "nth": nth, "reached": False})
                os.kill(pid, signal.SIGKILL)

            timer = threading.Timer(120, not_reached)
            timer.start()
            os.waitpid(pid, 0)
            timer.cancel()
            timer.join()  # no thread of the driver's is alive at the next fork
            continue
        os.waitpid(pid, 0)
    pid = os.fork()
    if pid == 0:
        try:
            check()
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(0)
    os.waitpid(pid, 0)


if __name__ == "__main__":
    main()
