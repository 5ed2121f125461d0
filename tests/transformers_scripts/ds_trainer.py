"""The tiny Trainer with ``deepspeed=`` (ZeRO ``STAGE``) in one CPU process (DeepSpeed's own process group of
one rank), stock or with lazyckpt.transformers installed.

argv: OUT MODE SCENARIO [RESUME]. MODE "stock" or "lazy"; SCENARIO "run" (4 steps, a checkpoint every 2),
"resume" (from RESUME, to step 4), "levels" (lazy, "run" with levels OUT/fast every 2 keeping 1 and OUT/slow
every 4) or "kill" (SIGKILLed right after the step-4 checkpoint's _save_checkpoint returned, once the step-2
checkpoint is committed and step 4's own files are durable).
"""

from __future__ import annotations

import os
import signal
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.transformers_scripts import tiny  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

import lazyckpt  # noqa: E402
import lazyckpt.transformers  # noqa: E402


class KillAfterSave(TrainerCallback):
    """Step 2's checkpoint committed before step 4 saves; SIGKILL once step 4's ``_save_checkpoint`` returned
    and its own files are durable (forced window: the folder must still wait for DeepSpeed's tag)."""

    def __init__(self) -> None:
        self.handle = None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == 3:  # step 3's engine.step() committed the step-2 tag
            for save in self.handle._checkpoints.pending():
                save.done.wait(60)

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == 4:
            self.handle.checkpointer.wait()  # the Trainer's own files of checkpoint-4 (not the tag)
            for save in self.handle._checkpoints.pending():
                save.done.wait(3)  # done only if the folder did not wait for the tag
            os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    out, mode, scenario = sys.argv[1:4]
    ds = {
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
        "zero_optimization": {"stage": int(os.environ.get("STAGE", "2"))}, "steps_per_print": 10**9,
    }  # fmt: skip
    tr = tiny.trainer(out, max_steps=4, save_steps=2, deepspeed=ds, use_cpu=False)
    assert tr.is_deepspeed_enabled
    kill = KillAfterSave() if scenario == "kill" else None
    if kill is not None:
        tr.add_callback(kill)
    levels = None
    if scenario == "levels":
        fast, slow = os.path.join(out, "fast"), os.path.join(out, "slow")
        levels = [lazyckpt.Level(fast, every=2, keep=1), lazyckpt.Level(slow, every=4)]
    handle = lazyckpt.transformers.install(tr, levels=levels) if mode == "lazy" else None
    if kill is not None:
        kill.handle = handle
    tr.train(resume_from_checkpoint=sys.argv[4] if scenario == "resume" else None)
    if handle is not None:
        assert type(tr.model_wrapped.checkpoint_engine).__name__ == "LazyCheckpointEngine"
        handle.uninstall()
        assert type(tr.model_wrapped.checkpoint_engine).__name__ != "LazyCheckpointEngine"


if __name__ == "__main__":
    from tests._util import run_then_exit

    run_then_exit(main)
