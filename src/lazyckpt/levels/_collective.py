"""``latest()`` on every rank of a job: one answer for all, agreed through the c10d store.

Each rank lists its levels (a node-local level's folder differs per node) and posts the steps it
holds; then, newest step first (only steps some level holds on every rank), each rank checks its
own copies of that step, fastest level first, for what IT would load (``check``: a DCP folder
through the files its manifest lists for this rank, anything else whole), and posts the level it
can use or none. The first step every rank can use is the answer everywhere; each rank's path is
its own fastest usable copy (rank 0 may read node memory while rank 1, whose memory copy is
corrupt, reads the same step from disk: the same state either way).

The exchange goes through the default c10d store (the job's rendezvous store, a TCP connection of
its own: never a collective on the training's process group, so nccl jobs are fine), each rank
polling for the others' keys with short requests until ``timeout``: a rank that never calls
``latest()`` (or died) makes the others raise ``TimeoutError`` naming it, never hang. Keys are
``lazyckpt/latest/<restart>/<call>/<round>/r<rank>`` (``<restart>``: torchrun's restart count, so
a store that outlives a restart never serves an older incarnation's answers), small JSON; each
rank deletes its key of a round once every rank has posted the next.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

_POLL_MIN_S, _POLL_MAX_S = 0.005, 0.1
_calls = itertools.count()


def active(collective: bool | None, listings: dict[int, dict[int, str]], is_dcp: Callable[[str], bool]) -> bool:
    """Whether ``latest()`` runs collectively: ``collective`` if given; else in a job
    (torch.distributed initialized, more than one rank) whose levels, as this rank lists them, hold
    a DCP folder of ``lazyckpt.distributed`` (``is_dcp``) or nothing at all (then this rank only
    posts that it holds nothing, for ranks that do: ``agree``). Levels holding other checkpoints
    only are one process's business (a caller may pick on one process and broadcast)."""
    if collective is not None:
        return collective
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return False
    paths = [path for steps in listings.values() for path in steps.values()]
    return not paths or any(is_dcp(path) for path in paths)


class StoreExchange:
    """``all_gather`` of small JSON values among ``world`` ranks through a c10d ``store``."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int, timeout: float) -> None:
        self.store, self.prefix, self.rank, self.world, self.timeout = store, prefix, rank, world, timeout
        self._round = 0

    @staticmethod
    def default_store() -> Any:
        """The default process group's key-value store (torch keeps it privately); the distributed
        checkpointer's commit protocol uses it too."""
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()

    @classmethod
    def default(cls, timeout: float) -> StoreExchange:
        """Over the default process group's ranks and store (torch.distributed initialized)."""
        import torch.distributed as dist

        store = cls.default_store()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"lazyckpt/latest/{restart}/{next(_calls)}"
        return cls(store, prefix, dist.get_rank(), dist.get_world_size(), timeout)

    def _key(self, round_no: int, rank: int) -> str:
        return f"{self.prefix}/{round_no}/r{rank}"

    def post(self, value: Any) -> int:
        """Post this rank's ``value`` for the next round without waiting for the others'; its round."""
        round_no, self._round = self._round, self._round + 1
        self.store.set(self._key(round_no, self.rank), json.dumps(value))
        return round_no

    def all_gather(self, value: Any) -> list[Any]:
        """Every rank's ``value`` (same order on all ranks); ``TimeoutError`` naming the ranks that
        did not post theirs within ``timeout`` seconds."""
        round_no = self.post(value)
        keys = [self._key(round_no, r) for r in range(self.world)]
        deadline = time.monotonic() + self.timeout
        delay = _POLL_MIN_S
        while True:
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            if not missing:
                break
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"lazyckpt.latest: rank(s) {missing} did not answer within {self.timeout:g} s (latest() is "
                    "collective: call it on every rank, or pass collective=False for one rank's own view)"
                )
            time.sleep(delay)
            delay = min(delay * 2, _POLL_MAX_S)
        values = [json.loads(bytes(self.store.get(key)).decode()) for key in keys]
        if round_no > 0:  # every rank posted this round: the previous one was read by all
            try:
                self.store.delete_key(self._key(round_no - 1, self.rank))
            except Exception:  # noqa: BLE001 - some stores cannot delete; the keys are small
                pass
        return values


def agree(
    listings: dict[int, dict[int, str]],
    check: Callable[[int, int, str], bool],
    exchange: StoreExchange,
) -> tuple[int, int, str] | None:
    """(step, level, path) agreed by every rank (the step is the same everywhere; level and path
    are this rank's fastest usable copy), or None. ``listings``: this rank's {level: {step: path}};
    ``check(level, step, path)``: whether this rank can load that copy (it warns if not)."""
    mine = {str(level): sorted(steps) for level, steps in listings.items()}
    if not any(listings.values()):  # no step is held by every rank: None, without waiting for them
        exchange.post({"value": mine})
        return None
    held = [_steps(ranks_listing.values()) for ranks_listing in _gather(exchange, lambda: mine)]
    for step in sorted(set().union(*held), reverse=True):
        if not all(step in steps for steps in held):
            continue  # some rank holds it nowhere: no round needed, the answer is no
        choices = _gather(exchange, functools.partial(_usable, listings, step, check))
        if all(answer is not None for answer in choices):
            choice = choices[exchange.rank]
            return step, choice, listings[choice][step]
    return None


def _usable(listings: dict[int, dict[int, str]], step: int, check: Callable[[int, int, str], bool]) -> int | None:
    """This rank's fastest level whose copy of ``step`` it can load, or None."""
    mine = [(level, steps[step]) for level, steps in sorted(listings.items()) if step in steps]
    return next((level for level, path in mine if check(level, step, path)), None)


def _gather(exchange: StoreExchange, compute: Callable[[], Any]) -> list[Any]:
    """Every rank's ``compute()``; a rank whose ``compute`` raised posts that it failed (then
    raises), so the others raise at once instead of waiting for it until their timeout."""
    try:
        value = compute()
    except BaseException as exc:
        exchange.all_gather({"failed": f"{type(exc).__name__}: {exc}"})
        raise
    answers = exchange.all_gather({"value": value})
    failed = [f"rank {r}: {a['failed']}" for r, a in enumerate(answers) if "failed" in a]
    if failed:
        raise RuntimeError("lazyckpt.latest failed on another rank: " + "; ".join(failed))
    return [a["value"] for a in answers]


def _steps(lists: Iterable[list[int]]) -> set[int]:
    return {int(s) for steps in lists for s in steps}
