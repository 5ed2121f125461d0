"""Child of the crash-consistency test: trains and checkpoints every step until killed.

Prints "DONE <path> <step>" (flushed) each time a save is durable, so the parent knows the newest
save that completed before it sent SIGKILL.
"""

from __future__ import annotations

import sys

import torch

import lazyckpt

out = sys.argv[1]
start = int(sys.argv[2])
torch.manual_seed(start)
model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.LayerNorm(256), torch.nn.Linear(256, 256))
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
ckpt = lazyckpt.LazyCheckpointer(host_memory_budget=8 << 20, chunk_bytes=256 << 10)


def report(step: int):
    def done(h: lazyckpt.SaveHandle) -> None:
        if h.exception() is None:
            print(f"DONE {h.path} {step}", flush=True)

    return done


print("READY", flush=True)
for step in range(start, start + 100_000):
    model(torch.randn(32, 256)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step, "blob": torch.randn(50_000)}
    ckpt.save(state, f"{out}/step-{step % 3}.pt").add_done_callback(report(step))
    ckpt.save(state, f"{out}/last.pt").add_done_callback(report(step))
