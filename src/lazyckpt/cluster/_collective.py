"""Collective ``latest()``: the newest step every rank can load, agreed through the c10d store.

Runs on the caller's thread over the default store, never a collective on the training's group; a
silent rank makes the others raise ``TimeoutError``. Keys include torchrun's restart count, so a
store outliving a restart never serves stale answers.
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


def in_job() -> bool:
    """torch.distributed initialized with more than one rank."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch without distributed
        return False
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class StoreExchange:
    """``all_gather`` of small JSON values among ``world`` ranks through a c10d ``store``."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int, timeout: float) -> None:
        self.store, self.prefix, self.rank, self.world, self.timeout = store, prefix, rank, world, timeout
        self._round = 0

    @staticmethod
    def default_store() -> Any:
        """The default process group's key-value store (a private torch API)."""
        import torch.distributed as dist

        return dist.distributed_c10d._get_default_store()

    @classmethod
    def default(cls, timeout: float) -> StoreExchange:
        """Over the default process group's ranks and store."""
        import torch.distributed as dist

        store = cls.default_store()
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        prefix = f"lazyckpt/latest/{restart}/{next(_calls)}"
        return cls(store, prefix, dist.get_rank(), dist.get_world_size(), timeout)

    def _key(self, round_no: int, rank: int) -> str:
        return f"{self.prefix}/{round_no}/r{rank}"

    def post(self, value: Any) -> int:
        """Post this rank's ``value`` for the next round without waiting; returns the round."""
        round_no, self._round = self._round, self._round + 1
        self.store.set(self._key(round_no, self.rank), json.dumps(value))
        return round_no

    def all_gather(self, value: Any, dead: Callable[[list[int]], list[int]] | None = None) -> list[Any]:
        """Every rank's ``value`` (same order on all ranks); ``TimeoutError`` naming the ranks that
        did not post theirs within ``timeout`` seconds, or ``RuntimeError`` as soon as ``dead`` (a
        heartbeat's view) names some of them."""
        round_no = self.post(value)
        keys = [self._key(round_no, r) for r in range(self.world)]
        deadline = time.monotonic() + self.timeout
        delay = _POLL_MIN_S
        while True:
            missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
            if not missing:
                break
            gone = dead(missing) if dead is not None and delay >= _POLL_MAX_S else []
            if gone:
                raise RuntimeError(f"lazyckpt: rank(s) {gone} died or vanished (no heartbeat) before answering")
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
    """(step, level, path) agreed by every rank, or None; level and path are this rank's fastest
    usable copy. ``listings``: {level: {step: path}}; ``check(level, step, path)``: loadable here."""
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
    """Every rank's ``compute()``; a rank whose ``compute`` raises posts the failure first, so the
    others raise ``RuntimeError`` at once instead of timing out."""
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
