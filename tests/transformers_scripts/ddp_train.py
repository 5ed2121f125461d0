"""Rank process of test_ddp_...: the tiny Trainer under torchrun (2 CPU processes, gloo).

argv: output folder, "1" (lazyckpt installed on every process) or "0" (stock). Rank 0 saves the final
weights to ``<out>/../final-<mode>.pt`` after training.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from tests.transformers_scripts import tiny  # noqa: E402

import lazyckpt.transformers  # noqa: E402


def main() -> None:
    out, lazy = sys.argv[1], sys.argv[2] == "1"
    tr = tiny.trainer(out, max_steps=6, save_steps=2, save_total_limit=2, ddp_backend="gloo")
    assert tr.args.world_size == 2, tr.args.world_size
    handle = lazyckpt.transformers.install(tr) if lazy else None
    tr.train()
    if handle is not None:
        handle.uninstall()
    if tr.args.process_index == 0:
        weights = {k: v.detach().clone() for k, v in tr.model.state_dict().items()}
        torch.save(weights, os.path.join(os.path.dirname(out), f"final-{'lazy' if lazy else 'stock'}.pt"))


if __name__ == "__main__":
    from tests._util import run_then_exit

    run_then_exit(main)  # no interpreter finalization: gloo's exit abort (tests/_util.py, README troubleshooting)
