"""2-process DDP training on CPU (gloo) with lazy save_state every step; run under ``accelerate launch``.

accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no --dynamo_backend no \
    --main_process_port PORT mp_train_save.py OUT
Writes OUT/expected_rank{r}.pt (state at the moment of one kept save) and OUT/summary.json (rank 0).
"""

import json
import os
import random
import sys

import acc_common as C  # this script's folder is first on the path
import numpy as np
import torch
from accelerate import Accelerator
from accelerate.utils import ProjectConfiguration

import lazyckpt.accelerate

MODEL = C.MP_MODEL


def broadcast(acc, obj):
    """The main process's copy of ``obj`` on every process."""
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def main():
    out = sys.argv[1]
    acc = Accelerator(
        cpu=True,
        project_config=ProjectConfiguration(
            project_dir=os.path.join(out, "proj"), automatic_checkpoint_naming=True, total_limit=2
        ),
    )
    assert acc.num_processes == 2, acc.num_processes
    rank = acc.process_index
    model, opt, sched = acc.prepare(*C.build(0, **MODEL))
    counter = C.Counter()
    acc.register_for_checkpointing(counter)
    torch.manual_seed(10 + rank)  # every process has its own RNG streams, so each RNG file differs
    random.seed(10 + rank)
    np.random.seed(10 + rank)
    gen = torch.Generator().manual_seed(100 + rank)  # and its own data
    C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])
    counter.bump()

    # Same state, explicit folders: stock first, then lazy.
    acc.project_configuration.automatic_checkpoint_naming = False
    acc.save_state(os.path.join(out, "stock_explicit"))
    handle = lazyckpt.accelerate.install(acc)
    acc.save_state(os.path.join(out, "lazy_explicit"))
    acc.project_configuration.automatic_checkpoint_naming = True

    expected = None
    for i in range(5):
        C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])
        counter.bump()
        snap = C.snapshot(acc, [model], [opt], [sched], [counter])
        if i == 3:
            expected = dict(snap, folder=f"checkpoint_{acc.save_iteration}")
        acc.save_state()
    last = dict(snap, folder=f"checkpoint_{acc.save_iteration - 1}")
    C.train_step(acc, model, opt, sched, gen, vocab=MODEL["vocab"])  # training moves on at once

    # lazy load_state right away (saves may still be pending on either process)
    acc.load_state()
    got = C.snapshot(acc, [model], [opt], [sched], [counter])
    # model files come from the main process; BatchNorm buffers differ per process under DDP
    main_models = [broadcast(acc, last["models"])]
    C.assert_same(got["models"], main_models[0], f"rank {rank} lazy load_state models")
    for k in ("opts", "scheds", "customs", "step", "torch_rng", "np_rng"):
        C.assert_same(got[k], last[k], f"rank {rank} lazy load_state {k}")
    assert got["py_rng"] == last["py_rng"], f"rank {rank} py rng"

    handle.wait()
    acc.wait_for_everyone()

    # save_state / load_state on the main process only (stock allows it without automatic naming):
    # lazyckpt adds no collective call, so this must not hang
    acc.project_configuration.automatic_checkpoint_naming = False
    if acc.is_main_process:
        main_only = C.snapshot(acc, [model], [opt], [sched], [counter])
        acc.save_state(os.path.join(out, "main_only"))
        acc.load_state(os.path.join(out, "main_only"))  # waits for its own pending saves, no collective
        got = C.snapshot(acc, [model], [opt], [sched], [counter])
        for k in ("models", "opts", "scheds", "customs"):
            C.assert_same(got[k], main_only[k], f"main only {k}")
    handle.wait()
    acc.wait_for_everyone()
    torch.save(expected, os.path.join(out, f"expected_rank{rank}.pt"))
    if acc.is_main_process:
        base = os.path.join(out, "proj", "checkpoints")
        summary = {
            "stock_explicit": C.file_tree(os.path.join(out, "stock_explicit")),
            "lazy_explicit": C.file_tree(os.path.join(out, "lazy_explicit")),
            "kept": sorted(os.listdir(base)),
            "kept_files": {d: C.file_tree(os.path.join(base, d)) for d in sorted(os.listdir(base))},
            "expected_folder": expected["folder"],
            "num_processes": acc.num_processes,
            "distributed_type": str(acc.distributed_type),
        }
        with open(os.path.join(out, "summary.json"), "w") as f:
            json.dump(summary, f)
    handle.uninstall()
    acc.wait_for_everyone()
    acc.end_training()


if __name__ == "__main__":
    main()
