"""The worker side of ``_launch.launch``: argv, the process group, one scenario from a dict, the
result JSON (with the traceback on failure), and ``os._exit`` so that a dead peer can never hang
the process at interpreter exit.

Usage of a worker script: ``worker.py SCENARIO RANK WORLD PORT WORKDIR``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any, NamedTuple

STACKS_AFTER_S = float(os.environ.get("LAZYCKPT_TEST_STACKS_AFTER_S", "0"))  # 0: off


class Args(NamedTuple):
    scenario: str
    rank: int
    world: int
    port: str
    workdir: str


def parse_argv(argv: list[str] | None = None) -> Args:
    a = sys.argv[1:] if argv is None else argv
    return Args(a[0], int(a[1]), int(a[2]), a[3], a[4])


def scenarios(namespace: dict[str, Any]) -> dict[str, Callable[[], None]]:
    """Every ``scenario_<name>`` function of a module's globals, by ``<name>``."""
    return {name[len("scenario_") :]: fn for name, fn in namespace.items() if name.startswith("scenario_")}


def run(args: Args, namespace: dict[str, Any], result: dict, init: Callable[[], None] | None = None) -> None:
    """``init()`` then the scenario ``args.scenario`` of ``namespace``; writes ``result`` (with
    ok=False, the error and the traceback on an exception) to WORKDIR/result-<rank>.json; exits."""
    if STACKS_AFTER_S:  # a rank still running after that long writes every thread's stack (again each
        import faulthandler  # period) to WORKDIR/stacks-<rank>.txt: where a slow multi-process test waits

        stacks = open(os.path.join(args.workdir, f"stacks-{args.rank}.txt"), "w")  # noqa: SIM115 - until os._exit
        faulthandler.dump_traceback_later(STACKS_AFTER_S, repeat=True, file=stacks)
    if init is not None:
        init()
    try:
        scenarios(namespace)[args.scenario]()
    except BaseException as exc:
        result.update(ok=False, error=f"{type(exc).__name__}: {exc}", traceback=traceback.format_exc())
    with open(os.path.join(args.workdir, f"result-{args.rank}.json"), "w") as fh:
        json.dump(result, fh)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
