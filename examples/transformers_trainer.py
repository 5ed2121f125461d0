"""Lazy ``checkpoint-N`` folders for a Hugging Face ``Trainer`` (CPU is fine; nothing is downloaded).

    python -m examples.transformers_trainer            # from the repository root

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


def trainer(out: str, max_steps: int) -> Trainer:
    model = GPT2LMHeadModel(GPT2Config(vocab_size=1024, n_positions=64, n_embd=128, n_layer=2, n_head=2))
    args = TrainingArguments(
        output_dir=out, max_steps=max_steps, save_steps=2, save_total_limit=2, per_device_train_batch_size=8,
        logging_steps=2, report_to=[], use_cpu=True, disable_tqdm=True,
    )  # fmt: skip
    return Trainer(model=model, args=args, train_dataset=Tokens())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default=None)
    out = ap.parse_args().dir or tempfile.mkdtemp(prefix="lazyckpt-trainer-")
    tr = trainer(out, max_steps=6)
    handle = lazyckpt.transformers.install(tr)  # <- lazyckpt
    tr.train()  # each checkpoint returns at once; train() returns with every folder committed
    print("blocked in each save (s):", [round(s, 4) for s in handle.save_seconds])
    handle.remove()  # <- lazyckpt (optional: back to stock saving)
    newest = lazyckpt.transformers.latest(out)  # <- lazyckpt (or stock resume_from_checkpoint=True)
    print("folders:", sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")), "newest complete:", newest)
    print("files:", sorted(os.listdir(newest)) if newest else None)
    resumed = trainer(out, max_steps=8)  # a stock Trainer reads the lazily written folder
    resumed.train(resume_from_checkpoint=newest)
    print("resumed to step", resumed.state.global_step)


if __name__ == "__main__":
    main()
