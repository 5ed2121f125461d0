"""Child of test_sigkill_mid_save...: trains the tiny Trainer saving every step until killed.

argv: output folder, "1" (lazyckpt installed) or "0" (stock). It resumes from the newest complete
checkpoint (``lazyckpt.transformers.latest``) and writes ``<out>/started`` once training runs. fsync is
slowed (30 ms) so that a kill often lands while a checkpoint is being written.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import transformers  # noqa: E402
from tests.transformers_scripts import tiny  # noqa: E402

import lazyckpt.transformers  # noqa: E402

_fsync = os.fsync


def slow_fsync(fd: int) -> None:
    time.sleep(0.03)
    _fsync(fd)


os.fsync = slow_fsync


class Started(transformers.TrainerCallback):
    def on_step_end(self, args, state, control, **kw):  # type: ignore[no-untyped-def]
        open(os.path.join(args.output_dir, "started"), "w").close()


def main() -> None:
    out, lazy = sys.argv[1], sys.argv[2] == "1"
    os.makedirs(out, exist_ok=True)
    resume = lazyckpt.transformers.latest(out) if lazy else transformers.trainer_utils.get_last_checkpoint(out)
    tr = tiny.trainer(out, max_steps=100_000, save_steps=1, logging_steps=1000)
    tr.add_callback(Started())
    if lazy:
        lazyckpt.transformers.install(tr)
    tr.train(resume_from_checkpoint=resume)


if __name__ == "__main__":
    main()
