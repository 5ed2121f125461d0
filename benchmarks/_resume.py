"""The resume half of ``benchmarks.bench_levels``: the time from a fresh process to a model and an
optimizer holding the newest checkpoint, from each level, against stock ``torch.load`` of the same file.

Each case runs in its own process (a real resume starts in a fresh process: no warm allocator, no
mapped file), which builds the model and its AdamW (untimed), drops the page cache (``sync; echo 3 >
/proc/sys/vm/drop_caches``, as root; a tmpfs file stays in memory, as it would), then times
``latest()`` + ``load()`` (or ``torch.load``) + ``model.load_state_dict`` + ``opt.load_state_dict``
(wall and the process's CPU seconds), and then four training steps. A loader that maps the file
(``torch.load(mmap=True)``, ``lazyckpt.load(mmap=True)``) leaves the optimizer's first step to copy
the pages it writes, a cost a reading loader pays while loading ("first step extra" = step 1 - the
median of steps 2-4). The resume's cost is counted to the end of that first step, less one steady
step: ``resume_s + first_step_extra_s`` ("to step s"), and every ratio is taken on it.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from . import gpt as _gpt

STEPS_AFTER = 4  # training steps after the resume: the first, and the median of the others to compare with


@dataclass(frozen=True)
class Case:
    """One way to resume: ``kind`` "lazyckpt" (``latest(levels)`` + ``load``) or "torch.load"
    (of ``path``, as stock loads it: ``weights_only=True``, ``mmap`` as given)."""

    name: str
    kind: str
    levels: tuple[str, ...] = ()
    path: str = ""
    verify: bool = True
    readers: int = 8
    mmap: bool = False


def cases(memory_dir: str, disk_dir: str, memory_file: str, disk_file: str) -> list[Case]:
    """Every level, verified or not, parallel or one reader; stock torch.load from disk and tmpfs.
    The disk cases list a memory level that is gone (a reboot), as a restarted job would."""
    gone = os.path.join(memory_dir, "gone-after-reboot")
    mem, disk = (memory_dir, disk_dir), (gone, disk_dir)
    return [
        Case("lazyckpt memory", "lazyckpt", mem),
        Case("lazyckpt memory, unverified", "lazyckpt", mem, verify=False),
        Case("lazyckpt memory, 1 reader", "lazyckpt", mem, readers=1),
        Case("lazyckpt memory (mmap=True)", "lazyckpt", mem, mmap=True),
        Case("lazyckpt disk", "lazyckpt", disk),
        Case("lazyckpt disk, unverified", "lazyckpt", disk, verify=False),
        Case("lazyckpt disk, 1 reader", "lazyckpt", disk, readers=1),
        Case("lazyckpt disk (mmap=True)", "lazyckpt", disk, mmap=True),
        Case("torch.load disk", "torch.load", path=disk_file),
        Case("torch.load /dev/shm", "torch.load", path=memory_file),
        Case("torch.load(mmap=True) disk", "torch.load", path=disk_file, mmap=True),
    ]


def make_files(size: str, memory_dir: str, disk_dir: str) -> tuple[str, str, int]:
    """One checkpoint of the trained model's {model, optim, step} at both levels, as the multi-level
    saver writes them (step 1): (memory file, disk file, bytes)."""
    from lazyckpt import LazyCheckpointer, Level

    cfg = _gpt.config_for(size)
    model = _gpt.build(cfg, seed=0)
    opt = _gpt.make_optimizer(model)
    _gpt.train_step(model, opt, _gpt.BatchStream(cfg, seed=0).next())
    levels = [Level(memory_dir, every=1, keep=1), Level(disk_dir, every=1, keep=1)]
    with LazyCheckpointer(levels=levels, fsync=True) as ck:
        ck.save({"model": model.state_dict(), "optim": opt.state_dict(), "step": 1}, step=1).wait()
    return levels[0].file(1), levels[1].file(1), os.path.getsize(levels[1].file(1))


def run_cases(
    size: str, threads: int | None, all_cases: list[Case], rounds: int, drop: bool, progress: Callable[[str], None]
) -> dict[str, list[dict[str, Any]]]:
    """Every case ``rounds`` times, each in a fresh process, the order rotating per round."""
    out: dict[str, list[dict[str, Any]]] = {c.name: [] for c in all_cases}
    for r in range(rounds):
        order = all_cases[r % len(all_cases) :] + all_cases[: r % len(all_cases)]
        for case in order:
            progress(f"resume round {r + 1}/{rounds}: {case.name}")
            out[case.name].append(_child(size, threads, case, drop))
    return out


def _child(size: str, threads: int | None, case: Case, drop: bool) -> dict[str, Any]:
    spec = json.dumps({"size": size, "threads": threads, "case": asdict(case), "drop": drop})
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks._resume", spec], capture_output=True, text=True, env=env, timeout=1800
    )
    if proc.returncode != 0:
        raise RuntimeError(f"resume case {case.name!r} failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def drop_page_cache() -> bool:
    """``sync; echo 3 > /proc/sys/vm/drop_caches``; False where that is not allowed (not root)."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def resume_once(size: str, case: Case, drop: bool) -> dict[str, Any]:
    """In this (fresh) process: build the model, drop the cache, resume as ``case`` says, train two steps."""
    import lazyckpt

    cfg = _gpt.config_for(size)
    model = _gpt.build(cfg, seed=1)
    opt = _gpt.make_optimizer(model)
    batches = _gpt.BatchStream(cfg, seed=0)
    gc.collect()
    dropped = drop_page_cache() if drop else False
    marks = [("start", time.perf_counter(), time.process_time())]

    def mark(name: str) -> None:
        marks.append((name, time.perf_counter(), time.process_time()))

    found_level = None
    if case.kind == "lazyckpt":
        found = lazyckpt.latest(list(case.levels), verify=case.verify, threads=case.readers)
        if found is None:
            raise RuntimeError(f"no checkpoint in {case.levels}")
        found_level = found.level
        mark("latest")
        state = lazyckpt.load(found, verify=case.verify, threads=case.readers, mmap=case.mmap or None)
        mark("load")
    else:
        state = torch.load(case.path, weights_only=True, mmap=case.mmap)
        mark("load")
    model.load_state_dict(state["model"])
    mark("model.load_state_dict")
    opt.load_state_dict(state["optim"])
    mark("optimizer.load_state_dict")
    del state
    steps = []
    for _ in range(STEPS_AFTER):
        t = time.perf_counter()
        _gpt.train_step(model, opt, batches.next())
        steps.append(time.perf_counter() - t)
    phases = {name: t - marks[i][1] for i, (name, t, _) in enumerate(marks[1:])}
    return {
        "case": case.name,
        "resume_s": marks[-1][1] - marks[0][1],
        "cpu_s": marks[-1][2] - marks[0][2],
        "phases": phases,
        "steps_s": steps,
        "first_step_extra_s": steps[0] - statistics.median(steps[1:]),
        "page_cache_dropped": dropped,
        "level": found_level,
        "torch_threads": torch.get_num_threads(),
    }


def summarize(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Medians over rounds per case, and each case's ratio to stock torch.load from disk and tmpfs."""
    out: dict[str, dict[str, Any]] = {}
    for name, rs in runs.items():
        if not rs:
            continue
        phases = sorted({p for r in rs for p in r["phases"]}, key=list(rs[0]["phases"]).index)
        out[name] = {
            "resume_s": statistics.median(r["resume_s"] for r in rs),
            "cpu_s": statistics.median(r["cpu_s"] for r in rs),
            "phases": {p: statistics.median(r["phases"].get(p, 0.0) for r in rs) for p in phases},
            "first_step_extra_s": statistics.median(r["first_step_extra_s"] for r in rs),
            "to_step_s": statistics.median(r["resume_s"] + r["first_step_extra_s"] for r in rs),
            "rounds": [r["resume_s"] for r in rs],
            "page_cache_dropped": all(r["page_cache_dropped"] for r in rs),
        }
    for ref in ("torch.load disk", "torch.load /dev/shm"):
        base = out.get(ref, {}).get("to_step_s")
        for s in out.values():
            s[f"speedup vs {ref}"] = base / s["to_step_s"] if base and s["to_step_s"] > 0 else None
    return out


def _main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    print(json.dumps(resume_once(spec["size"], Case(**spec["case"]), spec["drop"])))
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
