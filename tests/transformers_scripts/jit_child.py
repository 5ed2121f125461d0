"""Child of test_transformers_preemption: a tiny Trainer with ``enable_jit_checkpoint=True`` that sends
itself SIGTERM after step ``AT`` ends; the Trainer's own JIT path then saves ``checkpoint-AT`` at the next
step's start and this process is SIGKILLed the moment that save returns (a preempted job's end).

argv: output folder, "1" (lazyckpt installed) or "0" (stock), AT, SAVE_STEPS (``save_steps``: 1 = a
regular save of the same step is still pending when the JIT save starts).
"""

from __future__ import annotations

import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import transformers  # noqa: E402
from tests.transformers_scripts import tiny  # noqa: E402

import lazyckpt.transformers  # noqa: E402


class Preempt(transformers.TrainerCallback):
    """After step ``at``: SIGTERM to this process, then wait (bounded) until the JIT manager's timer has
    asked for the checkpoint, so the next step's start takes it."""

    def __init__(self, manager, at: int) -> None:  # type: ignore[no-untyped-def]
        self.manager, self.at = manager, at
        self.requested = threading.Event()
        enable = manager._enable_checkpoint  # the timer's callback: set the event once it has run
        manager._enable_checkpoint = lambda: (enable(), self.requested.set())

    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        if state.global_step != self.at:
            return
        os.kill(os.getpid(), signal.SIGTERM)
        if not self.requested.wait(30):
            raise TimeoutError("the JIT manager never asked for the checkpoint")


def main() -> None:
    out, lazy, at, save_steps = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), int(sys.argv[4])
    tr = tiny.trainer(out, max_steps=100, save_steps=save_steps, enable_jit_checkpoint=True, logging_steps=1000)
    manager = lazyckpt.transformers._compat.jit_manager(tr)
    manager.kill_wait = 0
    tr.add_callback(Preempt(manager, at))
    if lazy:
        lazyckpt.transformers.install(tr)
    jit = manager.execute_jit_checkpoint  # (lazyckpt's, when installed)

    def then_die() -> None:
        jit()
        print("JIT-RETURNED", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    manager.execute_jit_checkpoint = then_die
    tr.train()
    raise SystemExit("train() returned: the JIT checkpoint never ran")


if __name__ == "__main__":
    main()
