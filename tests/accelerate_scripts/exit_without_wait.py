"""Train, save_state lazily, and end the script without handle.wait(): the exit drain makes it durable.

python exit_without_wait.py TARGET EXPECTED_PT [STORAGE_OPTIONS_JSON LOCAL_DIR]

TARGET: a local folder, or a URL (then the storage options and the remote tier's local folder follow).
Writes EXPECTED_PT (the state at save_state) before it returns from main().

For a local folder the folder's end (marker removal) is held until the interpreter has started
exiting, then for one more second: without the handle's drain at exit the process is gone before
the marker goes and the folder reads as incomplete. A URL's upload starts after the local folder is
complete, i.e. during the exit: without a drain before the interpreter's shutdown, s3fs cannot upload.
"""

import atexit
import json
import sys
import threading
import time

import acc_common as C  # this script's folder is first on the path
import torch
from accelerate import Accelerator

import lazyckpt.accelerate
from lazyckpt.commit import folder as _folder

exiting = threading.Event()
atexit.register(exiting.set)  # registered after lazyckpt's exit registry: runs before its drain


def _hold_end(real):
    def end(self, *args, **kwargs):
        exiting.wait(60)  # bounded: a save_state that waits for its own end must not hang
        time.sleep(1.0)  # the window: the interpreter would be gone by now without a drain
        return real(self, *args, **kwargs)

    return end


def main():
    target, expected = sys.argv[1], sys.argv[2]
    kw = {}
    if len(sys.argv) > 3:
        kw = {"storage_options": json.loads(sys.argv[3]), "local_dir": sys.argv[4]}
    else:
        _folder.FolderSave.end = _hold_end(_folder.FolderSave.end)
    acc = Accelerator(cpu=True)
    model, opt, sched = acc.prepare(*C.build(0))
    lazyckpt.accelerate.install(acc, **kw)
    gen = torch.Generator().manual_seed(1)
    C.train_step(acc, model, opt, sched, gen)  # a step since install: save_state stays lazy
    snap = C.snapshot(acc, [model], [opt], [sched])
    acc.save_state(target)
    torch.save(snap, expected)
    C.train_step(acc, model, opt, sched, gen)


if __name__ == "__main__":
    main()
