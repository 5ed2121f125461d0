"""Lazy ``checkpoint-N`` folders for a Hugging Face ``Trainer`` (CPU is fine; nothing is downloaded).

    python -m examples.transformers_trainer            # from the repository root
    python -m examples.transformers_trainer --compare  # the main job's row: stock vs lazy, side by side

It trains a small GPT-2 built from a config with ``save_steps=2`` and ``save_total_limit=2``, with
lazyckpt installed (the lines it adds are marked ``# <- lazyckpt``), then resumes a stock Trainer from the
newest complete folder and prints what it found. Every folder holds the files stock writes.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

import lazyckpt.transformers  # <- lazyckpt


class Tokens(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 1024, (32,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def trainer(out: str, max_steps: int, save_steps: int = 2, n_embd: int = 128) -> Trainer:
    torch.manual_seed(0)
    ids = {"bos_token_id": 0, "eos_token_id": 0}
    config = GPT2Config(vocab_size=1024, n_positions=64, n_embd=n_embd, n_layer=2, n_head=2, **ids)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=out, max_steps=max_steps, save_steps=save_steps, save_total_limit=2,
        per_device_train_batch_size=8, logging_steps=1000, report_to=[], use_cpu=True, disable_tqdm=True, seed=0,
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=Tokens())


def compare(root: str, steps: int = 8) -> None:
    """Stock, lazy and no checkpoint, same seed, a checkpoint every step: the stall per checkpoint of
    each (train() time less the quicker of two no-checkpoint runs', over the checkpoints; lazy includes the drain at the
    end of train()), and whether the final weights agree. One run each: a demo, not a benchmark
    (benchmarks/bench_transformers.py alternates rounds)."""
    import time

    def run(name: str, lazy: bool, save_steps: int) -> tuple[float, dict]:
        tr = trainer(os.path.join(root, name), max_steps=steps, save_steps=save_steps, n_embd=384)
        handle = lazyckpt.transformers.install(tr) if lazy else None  # <- lazyckpt
        t = time.perf_counter()
        tr.train()
        elapsed = time.perf_counter() - t
        if handle is not None:
            handle.uninstall()
        return elapsed, {k: v.detach().clone() for k, v in tr.model.state_dict().items()}

    run("warm-up", False, steps + 1)
    first, _ = run("none", False, steps + 1)
    stock, w_stock = run("stock", False, 1)
    lazy, w_lazy = run("lazy", True, 1)
    none = min(first, run("none-again", False, steps + 1)[0])  # the quicker of two: a busy host drifts
    same = all(torch.equal(w_stock[k], w_lazy[k]) for k in w_stock)
    print(f"transformers Trainer, GPT-2 from a config, {steps} steps, checkpoint-N every step:")
    print(f"  stall per checkpoint: stock {(stock - none) / steps:.3f} s, lazy {(lazy - none) / steps:.3f} s")
    print(f"  final weights stock == lazy: {same}; folders: {sorted(os.listdir(os.path.join(root, 'lazy')))}")
    print("  (stock leaves its files in the page cache; lazyckpt fsyncs each file before the folder's rename)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    ap.add_argument("--compare", action="store_true", help="stock vs lazy stall per checkpoint, side by side")
    opts = ap.parse_args()
    out = opts.dir or tempfile.mkdtemp(prefix="lazyckpt-trainer-")
    if opts.compare:
        compare(out)
        return
    tr = trainer(out, max_steps=6)
    handle = lazyckpt.transformers.install(tr)  # <- lazyckpt
    tr.train()  # each checkpoint returns at once; train() returns with every folder committed
    print("blocked in each save (s):", [round(s, 4) for s in handle.save_seconds])
    handle.uninstall()  # <- lazyckpt (optional: back to stock saving)
    newest = lazyckpt.transformers.latest(out)  # <- lazyckpt (or stock resume_from_checkpoint=True)
    print("folders:", sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")), "newest complete:", newest)
    print("files:", sorted(os.listdir(newest.path)) if newest else None)
    resumed = trainer(out, max_steps=8)  # a stock Trainer reads the lazily written folder
    resumed.train(resume_from_checkpoint=newest.path)
    print("resumed to step", resumed.state.global_step)


if __name__ == "__main__":
    main()
