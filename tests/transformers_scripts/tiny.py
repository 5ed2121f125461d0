"""The tiny Trainer every transformers test runs: a GPT-2 from a config (2 layers, 32 wide, no download)."""

from __future__ import annotations

import os
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments, set_seed


class Tokens(torch.utils.data.Dataset):
    """``n`` fixed random token sequences (the same for every run)."""

    def __init__(self, n: int = 64, length: int = 16) -> None:
        self.n, self.length = n, length

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, 128, (self.length,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def model() -> GPT2LMHeadModel:
    return GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=32, n_embd=32, n_layer=2, n_head=2))


class PlainLM(torch.nn.Module):
    """Not a PreTrainedModel: the Trainer saves its state dict with ``safetensors.torch.save_file``."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(128, 16)
        self.head = torch.nn.Linear(16, 128)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        logits = self.head(self.emb(input_ids))
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return {"loss": loss, "logits": logits}


def trainer(
    out: str | os.PathLike[str], trainer_cls: type[Trainer] = Trainer, plain: bool = False, **overrides: Any
) -> Trainer:
    """A seeded tiny Trainer writing to ``out``; ``overrides`` go to ``TrainingArguments``; ``plain``: a
    model that is not a ``PreTrainedModel``."""
    set_seed(0)
    args: dict[str, Any] = dict(
        output_dir=os.fspath(out), max_steps=6, save_steps=2, per_device_train_batch_size=4, logging_steps=1,
        report_to=[], seed=0, disable_tqdm=True, use_cpu=True, dataloader_num_workers=0,
    )  # fmt: skip
    args.update(overrides)
    evaluate = args.get("eval_strategy", "no") != "no"
    return trainer_cls(
        model=PlainLM() if plain else model(), args=TrainingArguments(**args), train_dataset=Tokens(),
        eval_dataset=Tokens(16) if evaluate else None,
    )  # fmt: skip
