"""Child that saves and leaves without close(): on a normal exit, or on KeyboardInterrupt."""

from __future__ import annotations

import signal
import sys

import torch

import lazyckpt

out, mode = sys.argv[1], sys.argv[2]
ckpt = lazyckpt.LazyCheckpointer(host_memory_budget=1 << 20, chunk_bytes=128 << 10)
model = torch.nn.Linear(512, 512)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for i in range(5):
    model(torch.randn(8, 512)).sum().backward()
    opt.step()
    ckpt.save({"step": i, "w": model.weight}, f"{out}/ckpt-{i}.pt")
    if mode == "sigint" and i == 4:
        signal.raise_signal(signal.SIGINT)  # to this thread (os.kill may pick another): KeyboardInterrupt here
print("LEAVING", flush=True)
