#!/usr/bin/env python
"""Checkpoint every training step without stopping training: a plain PyTorch loop with lazyckpt.

Runs three times the same training (same seed, same batches) of a small GPT-like model on CPU:
without checkpoints, with a synchronous ``torch.save`` (+ fsync) after every step, and with
``LazyCheckpointer.save`` after every step. Prints what one checkpoint costs the training loop in each
case, then checks that the last lazy checkpoint loads with stock ``torch.load`` and holds exactly the
state at the moment ``save()`` was called, although training went on while it was being written.

    python -m examples.train_plain            # from the repository root; ~1 minute on 2 CPU cores
    python -m examples.train_plain --steps 40 --size tiny --out-dir /tmp/ckpts
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import torch

from benchmarks import gpt as _gpt  # the repository's one GPT (torch only), shared with the benchmarks
from lazyckpt import LazyCheckpointer


def torch_save(state: dict, path: Path) -> None:
    """What most training loops do: torch.save, made durable (fsync) and atomic (rename)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def train(mode: str, args, corpus: torch.Tensor, out_dir: Path, verify: bool = False) -> dict:
    """Train ``args.steps`` steps (+ 2 warm-up steps, not timed), checkpointing after every step."""
    cfg = _gpt.config_for(args.size)
    model = _gpt.build(cfg, seed=0)
    opt = _gpt.make_optimizer(model, lr=1e-3)
    batches = _gpt.BatchStream(cfg, seed=0, data=corpus)
    ckpt = LazyCheckpointer(writer_threads=4, fsync=True) if mode == "lazyckpt" else None
    path = out_dir / f"{mode.replace('.', '_')}.pt"
    result = {"mode": mode, "losses": []}

    def one_step(step: int) -> None:
        x, y = batches.next()
        opt.zero_grad(set_to_none=True)
        _, loss = model(x, y)
        loss.backward()
        opt.step()  # lazyckpt's step pre-hook waits here (only) until the previous checkpoint's copies are done
        result["losses"].append(loss.item())
        state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
        if mode == "torch.save":
            torch_save(state, path)
        elif mode == "lazyckpt":
            ckpt.save(state, path)  # returns at once; copies and writes happen in the background

    try:
        for step in range(2):  # warm-up: first-touch allocations, lazyckpt's host buffers
            one_step(step)
        if ckpt is not None:
            ckpt.wait()
        t0 = time.perf_counter()
        for step in range(2, 2 + args.steps):
            one_step(step)
        if ckpt is not None:
            ckpt.wait()  # the last checkpoint is durable on disk: counted in the time
        result["seconds"] = time.perf_counter() - t0

        if ckpt is not None and verify:
            # the timed loop's last checkpoint: no step has run since its save(), so it must equal the live state
            live = {"model": model.state_dict(), "optim": opt.state_dict(), "step": 1 + args.steps}
            assert_tree_equal(torch.load(path, map_location="cpu", weights_only=True), live)
            result.update(verify_lazy(ckpt, model, opt, batches, out_dir / "verify.pt"))
    finally:
        if ckpt is not None:
            ckpt.close()
    return result


def verify_lazy(ckpt, model, opt, batches, path: Path) -> dict:
    """Save, keep training two steps while the checkpoint is written, then compare the file with a
    snapshot of the state taken when save() was called."""
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": -1}
    handle = ckpt.save(state, path)
    expected = clone_tree(state)  # nothing has changed since save(): this is the state at save time
    for _ in range(2):  # training goes on and changes every parameter and optimizer tensor in place
        x, y = batches.next()
        opt.zero_grad(set_to_none=True)
        model(x, y)[1].backward()
        opt.step()
    stats = handle.wait()

    loaded = torch.load(path, map_location="cpu", weights_only=True)  # stock torch.load, nothing else
    assert_tree_equal(loaded, expected)
    live = {"model": model.state_dict(), "optim": opt.state_dict(), "step": -1}
    if trees_equal(loaded["model"], live["model"]):
        raise AssertionError("training did not move on: the check proves nothing")
    with zipfile.ZipFile(path) as zf:  # lazyckpt writes real CRC32s; torch.load never checks them
        bad = zf.testzip()
        if bad is not None:
            raise AssertionError(f"CRC mismatch in {bad}")
    return {"verified": path, "verify_stats": stats}


def clone_tree(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_tree(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_tree(v) for v in obj)
    return obj


def trees_equal(a, b) -> bool:
    try:
        assert_tree_equal(a, b)
        return True
    except AssertionError:
        return False


def assert_tree_equal(a, b, where: str = "") -> None:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            raise AssertionError(f"{where}: tensor vs {type(b).__name__}")
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            raise AssertionError(f"{where}: tensors differ")
    elif isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            raise AssertionError(f"{where}: keys differ: {sorted(map(str, set(a) ^ set(b)))[:5]}")
        for k in a:
            assert_tree_equal(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            raise AssertionError(f"{where}: lengths differ")
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_tree_equal(x, y, f"{where}[{i}]")
    elif a != b:
        raise AssertionError(f"{where}: {a!r} != {b!r}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Checkpoint every step: torch.save vs lazyckpt, plain PyTorch loop.")
    p.add_argument("--size", default="small", choices=sorted(_gpt.SIZES), help="model size (default: small, 14M)")
    p.add_argument("--steps", type=int, default=12, help="timed steps (= checkpoints) per run (default: 12)")
    p.add_argument("--rounds", type=int, default=3, help="runs of each mode, order rotating (default: 3)")
    p.add_argument("--out-dir", default=None, help="where checkpoints go (default: a temporary directory)")
    args = p.parse_args(argv)

    out_dir = Path(args.out_dir) if args.out_dir else Path(tempfile.mkdtemp(prefix="lazyckpt-example-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    corpus = torch.frombuffer(bytearray(Path(_gpt.__file__).read_bytes()), dtype=torch.uint8).long()

    cfg = _gpt.config_for(args.size)
    n_params = _gpt.num_params(_gpt.build(cfg))
    print(
        f"model: GPT {args.size}, {n_params / 1e6:.1f}M params, AdamW; checkpoint = model + optimizer "
        f"(~{12 * n_params / 1e6:.0f} MB) after every one of {args.steps} steps, {args.rounds} rounds; "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; files in {out_dir}",
        flush=True,
    )

    modes = ("no checkpoint", "torch.save", "lazyckpt")
    seconds = {m: [] for m in modes}
    losses = {}
    try:
        for r in range(args.rounds):  # the machine may be shared: repeat, rotate the order, pair within a round
            for mode in modes[r % 3 :] + modes[: r % 3]:
                run = train(mode, args, corpus, out_dir, verify=(r == args.rounds - 1))
                seconds[mode].append(run["seconds"])
                losses[mode] = run["losses"]
                if "verified" in run:
                    verified = run
                print(
                    f"  round {r + 1}/{args.rounds}  {mode:<14} {run['seconds']:6.2f} s   "
                    f"loss {run['losses'][0]:.3f} -> {run['losses'][-1]:.3f}",
                    flush=True,
                )

        base = seconds["no checkpoint"]
        stall = {
            m: statistics.median((t - b) / args.steps for t, b in zip(seconds[m], base, strict=True))
            for m in ("torch.save", "lazyckpt")
        }
        med = {m: statistics.median(seconds[m]) for m in modes}
        print()
        print(f"{'':30}{'no checkpoint':>14}{'torch.save':>12}{'lazyckpt':>12}")
        print(
            f"{f'time for {args.steps} steps (s, median)':30}{med['no checkpoint']:>14.2f}"
            f"{med['torch.save']:>12.2f}{med['lazyckpt']:>12.2f}"
        )
        print(f"{'stall per checkpoint (s)':30}{'':>14}{stall['torch.save']:>12.3f}{stall['lazyckpt']:>12.3f}")
        if stall["torch.save"] > 0:
            print(
                f"lazyckpt's stall is {max(stall['lazyckpt'], 0.0) / stall['torch.save']:.0%} of torch.save's "
                f"(stall = (time with checkpoints - time without) / checkpoints, median of {args.rounds} rounds)"
            )
        if min(stall.values()) < 0:
            print("(a negative stall means the machine's load changed between runs: rerun, or use more --rounds)")
        same = losses["lazyckpt"] == losses["no checkpoint"]
        print(f"losses identical with and without lazyckpt: {'yes' if same else 'no (nondeterministic kernels?)'}")

        st = verified["verify_stats"]
        print(
            f"verified with stock torch.load(weights_only=True): lazyckpt.pt (the last checkpoint of the timed run) "
            f"equals the state at its save(); {verified['verified'].name} ({st.file_bytes / 1e6:.0f} MB, durable "
            f"{st.durable_s:.2f} s after save()) equals the state at its save() although training ran 2 more "
            f"steps meanwhile, and its CRC32s check out"
        )
    finally:
        if not args.out_dir:
            shutil.rmtree(out_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
