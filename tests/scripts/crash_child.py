"""Child of the crash-consistency tests: trains and checkpoints every step until killed.

Usage: crash_child.py OUT START [POINT NTH]

Prints "DONE <path> <step>" (flushed) each time a save is durable, so the parent knows the newest
save that completed before the kill. Without POINT it runs until the parent kills it (the random
soak). With POINT (tests/_killpoints.py: create, mid-write, before-fsync, after-rename), it SIGKILLs
itself at the first write to reach that point once NTH saves are durable (a forced window), printing "KILL <point>" just
before, so the parent knows the window was reached.
"""

from __future__ import annotations

import sys

import torch

import _killpoints
import lazyckpt

out = sys.argv[1]
start = int(sys.argv[2])
point, nth = (sys.argv[3], int(sys.argv[4])) if len(sys.argv) > 4 else (None, 0)
durable = [0]  # saves reported durable; the kill point is armed at the NTH

torch.manual_seed(start)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = lazyckpt.LazyCheckpointer(host_memory_budget=8 << 20, chunk_bytes=256 << 10)


def report(step: int):
    def done(h: lazyckpt.SaveHandle) -> None:
        if h.exception() is None:
            print(f"DONE {h.path} {step}", flush=True)
            durable[0] += 1
            if point is not None and durable[0] == nth:  # earlier files of these names exist now
                _killpoints.arm(point, 1, lambda: print(f"KILL {point}", flush=True))

    return done


print("READY", flush=True)
for step in range(start, start + 100_000):
    model(torch.randn(32, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "blob": torch.randn(50_000)}
    ckpt.save(state, f"{out}/step-{step % 3}.pt").add_done_callback(report(step))
    ckpt.save(state, f"{out}/last.pt").add_done_callback(report(step))
    if point is not None and step - start > 1000:
        raise SystemExit(f"the kill point {point} was never reached")
