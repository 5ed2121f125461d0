"""Restore checkpoint folders with a STOCK Accelerator (lazyckpt is never imported) and dump what it loaded.

python stock_restore.py CONFIG_JSON OUT_PT
CONFIG_JSON: {"dirs": [...], "seed": int, "model": {vocab, dim, hidden}, "second_model": bool,
              "mixed_precision": "no", "grad_accum": 1, "scaler": bool, "custom": int}
OUT_PT: torch.save'd list of snapshots (acc_common.snapshot), one per folder, in order.
"""

import json
import sys

import acc_common as C  # this script's folder is first on the path
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState


def main():
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    out = sys.argv[2]
    results = []
    for d in cfg["dirs"]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(
            cpu=True,
            mixed_precision=cfg.get("mixed_precision", "no"),
            gradient_accumulation_steps=cfg.get("grad_accum", 1),
        )
        if cfg.get("scaler"):
            acc.scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        objs = C.build(cfg.get("seed", 0) + 1000, second_model=cfg.get("second_model", False), **cfg["model"])
        objs = list(acc.prepare(*objs))
        customs = [C.Counter() for _ in range(cfg.get("custom", 0))]
        if customs:
            acc.register_for_checkpointing(*customs)
        acc.load_state(d)
        models, opts, scheds = objs[0::3], objs[1::3], objs[2::3]
        results.append(C.snapshot(acc, models, opts, scheds, customs))
    assert "lazyckpt" not in sys.modules, "the stock restore must not import lazyckpt"
    torch.save(results, out)


if __name__ == "__main__":
    main()
