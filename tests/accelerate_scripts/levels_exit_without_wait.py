"""Save by level and end the script without handle.wait(): the exit drain makes every level's copy.

python levels_exit_without_wait.py MEM SECOND EXPECTED_PT [STORAGE_OPTIONS_JSON LOCAL_DIR]

SECOND: the slower level, a local folder or a URL (then the storage options and the remote tier's
local folder follow). Writes EXPECTED_PT (the state at the last save_state) before main() returns.
For a local slower level its copies are held until the interpreter has started exiting: without the
handle's drain at exit the process is gone before they are made. A URL level's copy of the last step
is uploaded during the exit: without a drain before the interpreter's shutdown, s3fs cannot upload.
"""

import atexit
import json
import sys
import threading

import acc_common as C  # this script's folder is first on the path
import torch
from accelerate import Accelerator

import lazyckpt.accelerate
from lazyckpt import Level
from lazyckpt.schedule import _copy

exiting = threading.Event()
atexit.register(exiting.set)  # registered after lazyckpt's exit registry: runs before its drain


def _held(real):
    def copy_tree(*args, **kwargs):
        exiting.wait(60)  # bounded: nothing may hang on it
        return real(*args, **kwargs)

    return copy_tree


def main():
    mem, second, expected = sys.argv[1:4]
    kw = {}
    if len(sys.argv) > 4:
        kw = {"storage_options": json.loads(sys.argv[4]), "local_dir": sys.argv[5]}
    else:
        _copy.copy_tree = _held(_copy.copy_tree)
    acc = Accelerator(cpu=True)
    model, opt, sched = acc.prepare(*C.build(0))
    # backlog 4: the 3 held copies never make save_state wait for them
    levels = [Level(mem, every=1, keep=2), Level(second, every=1, keep=2, backlog=4)]
    lazyckpt.accelerate.install(acc, levels=levels, **kw)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        C.train_step(acc, model, opt, sched, gen)
        snap = C.snapshot(acc, [model], [opt], [sched])
        acc.save_state()
    torch.save(snap, expected)
    C.train_step(acc, model, opt, sched, gen)


if __name__ == "__main__":
    main()
