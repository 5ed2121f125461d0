"""Restore a folder in 2 processes with a STOCK Accelerator, launched with notebook_launcher (CPU, gloo).

python mp_stock_load.py OUT FOLDER PORT  ->  OUT/loaded_rank{r}.pt
"""

import os
import sys


def restore(out, folder):
    import acc_common as C
    import torch
    from accelerate import Accelerator

    MODEL = C.MP_MODEL

    acc = Accelerator(cpu=True)
    assert acc.num_processes == 2
    model, opt, sched = acc.prepare(*C.build(999, **MODEL))
    counter = C.Counter()
    acc.register_for_checkpointing(counter)
    acc.load_state(folder)
    snap = C.snapshot(acc, [model], [opt], [sched], [counter])
    assert "lazyckpt" not in sys.modules, "the stock restore must not import lazyckpt"
    torch.save(snap, os.path.join(out, f"loaded_rank{acc.process_index}.pt"))
    acc.wait_for_everyone()


if __name__ == "__main__":
    from accelerate import notebook_launcher

    notebook_launcher(restore, args=(sys.argv[1], sys.argv[2]), num_processes=2, use_port=sys.argv[3])
