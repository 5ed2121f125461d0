"""Child that saves and leaves without close(): on a normal exit, or on KeyboardInterrupt."""

from __future__ import annotations

import signal
import sys

import torch

import lazyckpt

out, mode = sys.argv[1], sys.argv[2]
# Python leaves SIGINT ignored when it starts with it ignored (a background job of a non-interactive
# shell, as CI may run it): Ctrl-C must raise KeyboardInterrupt here whatever the parent did.
signal.signal(signal.SIGINT, signal.default_int_handler)
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
