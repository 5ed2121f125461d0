"""transformers Trainer: training stall per checkpoint, stock vs ``lazyckpt.transformers.install``, in one run.

    python -m benchmarks.bench_transformers                  # GPT-2 from a config (~5M params), CPU
    python -m benchmarks.bench_transformers --layers 2 --width 64 --rounds 1   # quick look

(from the repository root, with ``pip install -e .[transformers]``; nothing is downloaded)

For each regime (``torch.set_num_threads(1)``: a spare core for lazyckpt's threads; torch's default
threads: every core busy training) and each ``save_steps`` (1 and 10), three modes train the same seeded
Trainer for the same steps, interleaved ``--rounds`` times:

* ``none``   ``save_strategy="no"``
* ``stock``  ``save_steps=N`` (stock Trainer: synchronous writes, no fsync)
* ``lazy``   the same after ``lazyckpt.transformers.install(trainer)`` (fsync, atomic folder rename)

Each run's step interval ``i`` is the time between ``on_step_begin`` of steps ``i`` and ``i + 1``
(after ``--warmup`` steps): step ``i``, the checkpoint saved after it, if any, and so the time the save
call blocked; the wait for that checkpoint's copies falls in the next interval (its optimizer step).
With ``save_steps=10``, stall per checkpoint saved after step ``k`` = (interval ``k`` - base) +
(interval ``k + 1`` - base), base = the median of the same run's intervals that hold no save and no wait
(neighbours in time, so drift between runs on a shared machine cancels); its mean over the run's
checkpoints. With ``save_steps=1`` (every interval holds one save and the wait for the previous one):
the run's mean interval - the median interval of the ``none`` run of the same round. Median over rounds.
The end of ``train()`` (lazy: the last checkpoint's drain)
is outside the window: in a long run only the last checkpoint is not overlapped. "in save" is the time
the save call itself blocked (stock: the wrapped ``_save_checkpoint``; lazy: ``handle.save_seconds``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

import lazyckpt.transformers


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int, length: int, vocab: int) -> None:
        self.n, self.length, self.vocab = n, length, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class Intervals(TrainerCallback):
    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
        self.stamps.append(time.perf_counter())


def run(mode: str, save_steps: int, steps: int, out: str, cfg: dict[str, int]) -> tuple[list[float], list[float]]:
    """One training run; (step intervals, seconds each save call blocked)."""
    set_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=cfg["vocab"], n_positions=cfg["seq"], n_embd=cfg["width"], n_layer=cfg["layers"],
                   n_head=max(1, cfg["width"] // 64))
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=out, max_steps=steps, save_strategy="no" if mode == "none" else "steps", save_steps=save_steps,
        save_total_limit=2, per_device_train_batch_size=cfg["batch"], logging_steps=10_000, report_to=[],
        disable_tqdm=True, use_cpu=True, seed=0,
    )  # fmt: skip
    tr = Trainer(model=model, args=args, train_dataset=Tokens(steps * cfg["batch"], cfg["seq"], cfg["vocab"]))
    clock = Intervals()
    tr.add_callback(clock)
    in_save: list[float] = []
    handle = None
    if mode == "lazy":
        handle = lazyckpt.transformers.install(tr)
    elif mode == "stock":
        stock_save = tr._save_checkpoint

        def timed(*a: Any, **k: Any) -> None:
            t0 = time.perf_counter()
            stock_save(*a, **k)
            in_save.append(time.perf_counter() - t0)

        tr._save_checkpoint = timed  # type: ignore[method-assign]
    tr.train()
    if handle is not None:
        in_save = list(handle.save_seconds)
        handle.uninstall()
    s = clock.stamps
    return [b - a for a, b in zip(s, s[1:], strict=False)], in_save


def stall_per_checkpoint(intervals: list[float], save_steps: int, warmup: int, none_base: float) -> float:
    """Mean over the run's timed checkpoints of the extra time in the interval of the save and the next."""
    # interval i starts at step i + 1 (1-based global step); a save follows steps divisible by save_steps
    saved = [i for i in range(warmup, len(intervals) - 1) if (i + 1) % save_steps == 0]
    touched = {j for i in saved for j in (i, i + 1)}
    if save_steps == 1:  # every interval holds one save and the wait for the one before: one each
        return statistics.fmean(intervals[warmup:]) - none_base
    base = statistics.median(x for j, x in enumerate(intervals[warmup:], warmup) if j not in touched)
    return statistics.fmean(intervals[i] + intervals[i + 1] - 2 * base for i in saved)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2, help="untimed step intervals at the start of a run")
    ap.add_argument(
        "--min-steps",
        type=int,
        default=30,
        help="timed steps per run, at least (10 until 2026-12-05: one slow step moved a mean by 0.01 s)",
    )
    ap.add_argument("--dir", default=None, help="where checkpoints go (default: a temporary folder on disk)")
    ap.add_argument("--save-steps", default="1,10")
    ap.add_argument("--regimes", default="1,default", help="torch threads: 1 (a spare core) and/or default")
    a = ap.parse_args()
    base = a.dir or tempfile.mkdtemp(prefix="bench-transformers-", dir=os.getcwd())  # on disk, not a tmpfs /tmp
    try:
        _main(a, base)
    finally:
        if not a.dir:  # ~2 GB of checkpoint folders after a full run
            shutil.rmtree(base, ignore_errors=True)


def _main(a: argparse.Namespace, base: str) -> None:
    cfg = dict(layers=a.layers, width=a.width, vocab=a.vocab, seq=a.seq, batch=a.batch)
    default_threads = torch.get_num_threads()
    shape = GPT2Config(
        vocab_size=a.vocab, n_positions=a.seq, n_embd=a.width, n_layer=a.layers, n_head=max(1, a.width // 64)
    )
    n_params = sum(p.numel() for p in GPT2LMHeadModel(shape).parameters())
    print(f"GPT-2 from config: {n_params / 1e6:.1f}M params (AdamW: ~{n_params * 12 / 1e6:.0f} MB per checkpoint), "
          f"{os.cpu_count()} CPUs, folder {base}")  # fmt: skip
    for regime in a.regimes.split(","):
        threads = 1 if regime == "1" else default_threads
        torch.set_num_threads(threads)
        for save_steps in (int(s) for s in a.save_steps.split(",")):
            steps = a.warmup + 1 + max(a.min_steps, 3 * save_steps)
            stall: dict[str, list[float]] = {"stock": [], "lazy": []}
            blocked: dict[str, list[float]] = {"stock": [], "lazy": []}
            for r in range(a.rounds):
                runs = {}
                for mode in ("none", "stock", "lazy"):
                    iv, in_save = run(mode, save_steps, steps, os.path.join(base, f"{mode}-{save_steps}-{r}"), cfg)
                    runs[mode] = iv
                    blocked.get(mode, []).extend(in_save)
                none_base = statistics.median(runs["none"][a.warmup :])
                for mode in ("stock", "lazy"):
                    stall[mode].append(stall_per_checkpoint(runs[mode], save_steps, a.warmup, none_base))
                print(f"  threads={threads} save_steps={save_steps} round {r}: median step none {none_base:.4f} s, "
                      f"stall stock {stall['stock'][-1]:.4f}, lazy {stall['lazy'][-1]:.4f}", flush=True)  # fmt: skip
            s_stock, s_lazy = statistics.median(stall["stock"]), statistics.median(stall["lazy"])
            b_stock, b_lazy = statistics.median(blocked["stock"]), statistics.median(blocked["lazy"])
            ratio = s_lazy / s_stock if s_stock > 0 else float("nan")
            print(f"threads={threads:>2} save_steps={save_steps:>2}: stall per checkpoint stock {s_stock:.4f} s, "
                  f"lazy {s_lazy:.4f} s, lazy/stock {ratio:.3f}; in save stock {b_stock:.4f} s, lazy {b_lazy:.4f} s "
                  f"({b_lazy / b_stock:.3f})", flush=True)  # fmt: skip
    torch.set_num_threads(default_threads)


if __name__ == "__main__":
    main()
