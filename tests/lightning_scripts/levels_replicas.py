"""One rank of the Lightning DDP node-loss test (tests/test_lightning_levels.py), started by the test as
torchrun would (``LOCAL_RANK`` set: Lightning starts no process), the process group initialized before
the Trainer is made (Lightning then uses it), so that ``lazyckpt.latest(levels)`` before ``fit`` is the
collective it is in a job. Each of the 2 ranks stands for a node: its own memory folder
WORKDIR/memr/node<rank>; strategy="ddp", so global rank 0 alone saves the full state and the other
node's first rank holds a copy of each step (``Level(..., replicas=1)``).

Usage: levels_replicas.py SCENARIO RANK WORLD PORT WORKDIR (``tests/_worker.py``).

- ``first``: an uninterrupted fit to 10 (its state's digest, every rank), then a fit to 5 with the
  levels [memr/node<rank> every 1 keep 2 replicas 1, diskr every 3 keep 2].
- ``resume`` (a fresh job; the test may have emptied node folders): ``found = lazyckpt.latest(levels)``,
  then a stock resume ``fit(ckpt_path=found.path)`` to 10.
- ``resume_in_fit``: no process group before ``fit`` (Lightning makes it); ``MultiLevelCheckpoint(levels,
  resume=True)`` and a bare ``fit`` to 10.
- ``first_plain``, ``resume_in_fit_plain``: the same with ``replicas=0`` (node 1's memory stays empty).
"""

from __future__ import annotations

import os
import warnings
from datetime import timedelta

import _worker

ARGS = _worker.parse_argv()
os.environ.update(LOCAL_RANK=str(ARGS.rank), NODE_RANK="0", WORLD_SIZE=str(ARGS.world), MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=ARGS.port)  # fmt: skip

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lazyckpt  # noqa: E402
from lazyckpt import Level  # noqa: E402
from lazyckpt.lightning import LazyCheckpointIO, MultiLevelCheckpoint  # noqa: E402
from lightning_scripts.levels_gpt import StepGPT, digest, level_trainer, state_of  # noqa: E402

RESULT: dict = {"ok": True}
STEPS = 10


def levels() -> list[Level]:
    replicas = 0 if ARGS.scenario.endswith("_plain") else 1
    return [
        # backlog: every step's copy to the other node may queue (a loaded CI machine fell behind the
        # default 2 and skipped step 10's, by design, warned): this test checks what arrives, not the bound
        Level(os.path.join(ARGS.workdir, "memr", f"node{ARGS.rank}"), every=1, keep=2, replicas=replicas, backlog=16),
        Level(os.path.join(ARGS.workdir, "diskr"), every=3, keep=2),
    ]


def fit(steps: int, level_list: list[Level] | None, ckpt_path: str | None = None, resume: bool = False) -> str:
    torch.manual_seed(0)
    callbacks = [MultiLevelCheckpoint(level_list, resume=resume)] if level_list else []
    trainer = level_trainer(callbacks, [LazyCheckpointIO()], max_steps=steps, devices=2, strategy="ddp",
                            deterministic=False)  # fmt: skip
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        trainer.fit(StepGPT(batches=8), ckpt_path=ckpt_path)
    RESULT.setdefault("warnings", []).extend(str(w.message) for w in seen if "lazyckpt" in str(w.message))
    RESULT["global_step"] = trainer.global_step
    if resume:
        found = callbacks[0].resumed_from
        RESULT["found"] = None if found is None else [found.step, found.level]
    return digest(state_of(trainer))


def scenario_first() -> None:
    RESULT["reference"] = fit(STEPS, None)
    fit(5, levels())


def scenario_resume() -> None:
    found = lazyckpt.latest(levels())  # collective: a lost node's memory comes back from its holder
    RESULT["found"] = None if found is None else [found.step, found.level]
    RESULT["digest"] = fit(STEPS, levels(), ckpt_path=found.path if found else None)


def scenario_resume_in_fit() -> None:
    """No process group before ``fit`` (Lightning makes it, as with its own launcher or SLURM):
    ``MultiLevelCheckpoint(levels, resume=True)`` finds the step at setup, collectively."""
    assert not dist.is_initialized()
    RESULT["digest"] = fit(STEPS, levels(), resume=True)


def scenario_first_plain() -> None:
    """``first`` with a memory level without replicas (rank 0's node alone holds its steps)."""
    scenario_first()


def scenario_resume_in_fit_plain() -> None:
    """``resume_in_fit`` over those levels: the ranks must agree on a step every rank can load."""
    scenario_resume_in_fit()


def init() -> None:
    if ARGS.scenario.startswith("resume_in_fit"):
        return  # Lightning initializes the process group inside fit
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ARGS.port}", rank=ARGS.rank,
                            world_size=ARGS.world, timeout=timedelta(seconds=120))  # fmt: skip


if __name__ == "__main__":
    _worker.run(ARGS, globals(), RESULT, init)
