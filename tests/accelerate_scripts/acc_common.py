"""Shared pieces of the Accelerate tests and their subprocess scripts (model, training step, snapshots).

Imported as ``accelerate_scripts.acc_common`` by the tests and as ``acc_common`` by the scripts (their
own folder is first on the path); both need tests/ on the path (``_util``), which pytest and the
tests' subprocess environments provide.
"""

from __future__ import annotations

import copy
import os
import random
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from _util import assert_same

__all__ = ["assert_same"]  # the suite's one comparison (tests/_util.py), used by the scripts as C.assert_same

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
TESTS = REPO / "tests"


class TinyLM(nn.Module):
    """Embedding + MLP + BatchNorm + a head tied to the embedding, and one frozen parameter.

    The tied head gives two state_dict keys on one storage (safetensors drops one, as stock does); the
    BatchNorm buffers change in the forward pass; the frozen parameter is not owned by any optimizer.
    """

    def __init__(self, vocab: int = 64, dim: int = 16, hidden: int = 32):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.fc = nn.Linear(dim, hidden)
        self.bn = nn.BatchNorm1d(hidden)
        self.out = nn.Linear(hidden, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight
        self.frozen = nn.Parameter(torch.randn(8), requires_grad=False)
        self.vocab = vocab

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx).mean(1)
        x = self.out(F.relu(self.bn(self.fc(x))))
        return self.head(x) + self.frozen.sum() * 0.0


def build(seed: int, *, vocab=64, dim=16, hidden=32, second_model=False, lr=1e-2):
    torch.manual_seed(seed)
    model = TinyLM(vocab, dim, hidden)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    objs = [model, opt, sched]
    if second_model:
        m2 = nn.Linear(8, 4)
        o2 = torch.optim.SGD(m2.parameters(), lr=0.1, momentum=0.9)
        s2 = torch.optim.lr_scheduler.StepLR(o2, 1, gamma=0.9)
        objs += [m2, o2, s2]
    return objs


def batch(gen: torch.Generator, vocab: int = 64, bsz: int = 8, seq: int = 4):
    idx = torch.randint(0, vocab, (bsz, seq), generator=gen)
    tgt = torch.randint(0, vocab, (bsz,), generator=gen)
    return idx, tgt


def train_step(acc, model, opt, sched, gen, *, vocab=64, extra=None, accumulate=False, inf=False):
    """One Accelerate-style step: forward, accelerator.backward, optimizer.step, scheduler.step."""
    idx, tgt = batch(gen, vocab)
    ctx = acc.accumulate(model) if accumulate else _null()
    with ctx:
        with acc.autocast():
            loss = F.cross_entropy(model(idx).float(), tgt)
            loss = loss + torch.rand(()) * 0.0  # consumes the global RNG like dropout would
            if inf:
                loss = loss * float("inf")
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()
        if extra is not None:
            m2, o2, s2 = extra
            l2 = m2(torch.randn(4, 8, generator=gen)).pow(2).mean()
            acc.backward(l2)
            o2.step()
            s2.step()
            o2.zero_grad()
    return float(loss.detach())


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class Counter:
    """A custom object for register_for_checkpointing (tensor + plain Python state)."""

    def __init__(self):
        self.n = 0
        self.history: list[int] = []
        self.t = torch.zeros(3)

    def bump(self):
        self.n += 1
        self.history.append(self.n)
        self.t += 1  # in place, right after save_state: the saved copy must not see it

    def state_dict(self):
        return {"n": self.n, "history": self.history, "t": self.t}

    def load_state_dict(self, sd):
        self.n = sd["n"]
        self.history = list(sd["history"])
        self.t = sd["t"].clone()


def snapshot(acc, models, opts, scheds, customs=()):
    """A deep copy of everything save_state saves, taken at save time."""
    return {
        "models": [copy.deepcopy(acc.unwrap_model(m).state_dict()) for m in models],
        "opts": [copy.deepcopy(o.state_dict()) for o in opts],
        "scheds": [copy.deepcopy(s.state_dict()) for s in scheds],
        "customs": [copy.deepcopy(c.state_dict()) for c in customs],
        "torch_rng": torch.get_rng_state().clone(),
        "py_rng": random.getstate(),
        "np_rng": np.random.get_state()[1].copy(),
        "step": acc.step,
        "scaler": acc.scaler.state_dict() if acc.scaler is not None else None,
    }


def file_tree(folder) -> list[str]:
    out = []
    for root, _dirs, files in os.walk(folder):
        for f in files:
            out.append(os.path.relpath(os.path.join(root, f), folder))
    return sorted(out)


# model size of the 2-process tests (mp_train_save.py / mp_stock_load.py)
MP_MODEL = dict(vocab=512, dim=64, hidden=256)
