"""Train, save a complete checkpoint, then save again and get SIGKILLed before that save is durable.

python crash_after_save.py PROJECT_DIR EXPECTED_PT
Writes EXPECTED_PT (snapshot at the time of the first, complete save) before the crash.
"""

import os
import signal
import sys

import acc_common as C  # this script's folder is first on the path
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import lazyckpt.accelerate


def main():
    project, expected = sys.argv[1], sys.argv[2]
    acc = Accelerator(
        cpu=True, project_config=ProjectConfiguration(project_dir=project, automatic_checkpoint_naming=True)
    )
    # big enough (~50 MB with AdamW state) that writing it takes far longer than the kill below
    model, opt, sched = acc.prepare(*C.build(0, vocab=4096, dim=1024, hidden=1024))
    handle = lazyckpt.accelerate.install(acc)
    gen = torch.Generator().manual_seed(1)
    C.train_step(acc, model, opt, sched, gen, vocab=4096)
    snap = C.snapshot(acc, [model], [opt], [sched])
    acc.save_state()  # checkpoint_0: complete
    handle.wait()
    torch.save(snap, expected)
    C.train_step(acc, model, opt, sched, gen, vocab=4096)
    acc.save_state()  # checkpoint_1: killed before it is durable
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
