"""Child of test_signals: a training loop whose SIGUSR1 handler saves a checkpoint with ``ckpt.save`` and
reads it back at once (it must be durable and hold the state of that moment), the signal forced into each
window where the main thread is inside lazyckpt.

argv[1]: output folder. Four save / step / wait / remove cycles (two with the stager held until the
main thread blocks, so its waiting paths run) with the signal raised right after the main thread takes
any lazyckpt lock (the handler runs while it holds it); prints ``FIRED <n> <code locations>``. Then
the waits: the signal sent to the main thread while it is blocked in ``handle.wait()``, in
``ckpt.wait()`` and in the step guard's wait for copies (a writer held until the handler has run),
``ARMED <window>`` before and ``OK <window>`` after each. A deadlock leaves the parent's timeout to
kill it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import torch

from lazyckpt import LazyCheckpointer
from lazyckpt.core import plan
from lazyckpt.threads import reentry

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAIN = threading.main_thread()
OUT = sys.argv[1]
plan.INLINE_MAX_BYTES = plan.TINY_MAX_BYTES = 0  # the background path for this small checkpoint (GPU training)

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
ckpt = LazyCheckpointer(host_memory_budget=64 << 20, chunk_bytes=1 << 16)
ckpt.track(opt)


def state() -> dict:
    return {"model": model.state_dict(), "opt": opt.state_dict()}


def step() -> None:
    loss = model(torch.randn(16, 64)).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


# -- the handler: a save that must be durable and right when it returns ---------------------------------
results: list[str] = []


def handler(signum, frame):  # type: ignore[no-untyped-def]
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    path = os.path.join(OUT, f"signal-{len(results)}.pt")
    ckpt.save({"model": model.state_dict()}, path)  # (a handle; durable already, as the load below shows)
    got = torch.load(path, weights_only=True)["model"]
    same = all(torch.equal(got[k], v) for k, v in expected.items())
    results.append(f"{'same' if same else 'DIFFERENT'} depth={reentry.depth()}")


signal.signal(signal.SIGUSR1, handler)


def raise_signal() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)


# -- the lock windows -----------------------------------------------------------------------------------
_acquire = reentry.Lock.acquire
armed = False
seen: list[str] = []


def _site() -> str:
    """The lazyckpt code taking the lock: the first frame out of threading, reentry and this script."""
    f = sys._getframe(1)
    while f is not None and os.path.basename(f.f_code.co_filename) in ("threading.py", "reentry.py", _ME):
        f = f.f_back
    assert f is not None
    return f"{os.path.relpath(f.f_code.co_filename, ROOT)}:{f.f_lineno}"


_ME = os.path.basename(__file__)


def trap() -> None:
    """Right after the main thread took a lazyckpt lock: the signal, its handler run here, the lock held."""
    if not (armed and threading.current_thread() is MAIN and not results_pending[0]):
        return
    site = _site()
    if site not in seen:
        seen.append(site)
    results_pending[0] = True
    try:
        raise_signal()
    finally:
        results_pending[0] = False
    if not results[-1].startswith("same") or results[-1].endswith("depth=0"):
        bad.append(f"{site}: {results[-1]}")


_lock_enter = reentry.Lock.__enter__


def traced_acquire(self, blocking=True, timeout=-1):  # type: ignore[no-untyped-def]
    got = _acquire(self, blocking, timeout)
    if got:
        trap()
    return got


def traced_enter(self):  # type: ignore[no-untyped-def]
    got = _lock_enter(self)
    trap()
    return got


bad: list[str] = []
results_pending = [False]  # no tracing inside the handler itself
reentry.Lock.acquire = traced_acquire  # type: ignore[method-assign]
reentry.Lock.__enter__ = traced_enter  # type: ignore[method-assign]


def cycle(i: int) -> None:
    h = ckpt.save(state(), os.path.join(OUT, "lazy.pt"))
    step()
    h.wait()
    ckpt.remove(os.path.join(OUT, "lazy.pt")).result(30)
    ckpt.save(state(), os.path.join(OUT, f"lazy-{i}.pt"))
    step()
    ckpt.wait()


# -- the wait windows: the main thread blocked, the stager held until the handler has run -------------------
hold = threading.Event()
_stage = ckpt._engine._stager._handle


def held_stage(job):  # type: ignore[no-untyped-def]
    hold.wait(60)
    return _stage(job)


def signal_when_blocked(where: str) -> None:
    """From a helper thread: once the main thread is blocked inside ``where`` (a function of lazyckpt
    on its stack, and a ``wait`` of threading on top), raise the signal; the handler runs in the main
    thread inside that wait; then release the writer."""

    def run() -> None:
        deadline = time.monotonic() + 30
        while not main_blocked(where) and time.monotonic() < deadline:
            time.sleep(0.001)
        n = len(results)
        signal.pthread_kill(MAIN.ident, signal.SIGUSR1)  # to the main thread: it wakes in its wait, runs the handler
        while len(results) == n and time.monotonic() < deadline:
            time.sleep(0.001)
        hold.set()

    threading.Thread(target=run, daemon=True).start()


def main_blocked(where: str = "") -> bool:
    frame = sys._current_frames().get(MAIN.ident)
    names = []
    while frame is not None:
        names.append(frame.f_code.co_name)
        frame = frame.f_back
    return bool(names) and names[0] in ("wait", "acquire") and (not where or where in names)


def held_cycle(i: int) -> None:
    """A cycle with the stager held until the main thread blocks in a wait of lazyckpt (its waiting paths)."""

    def release() -> None:
        deadline = time.monotonic() + 10
        while not main_blocked() and time.monotonic() < deadline:
            time.sleep(0.001)
        hold.set()

    hold.clear()
    ckpt._engine._stager._handle = held_stage
    threading.Thread(target=release, daemon=True).start()
    try:
        cycle(i)
    finally:
        hold.set()
        ckpt._engine._stager._handle = _stage


def wait_window(name: str) -> None:
    hold.clear()
    ckpt._engine._stager._handle = held_stage
    try:
        if name == "handle.wait":
            signal_when_blocked("wait_done")
            ckpt.save(state(), os.path.join(OUT, "w.pt")).wait()
        elif name == "ckpt.wait":
            signal_when_blocked("_drain")
            ckpt.save(state(), os.path.join(OUT, "w.pt"))
            ckpt.wait()
        elif name == "guard":
            ckpt._engine._stager._handle = _stage
            copy = ckpt._engine._copy_piece  # the stager holds a piece mid-copy: the step must wait for it
            ckpt._engine._copy_piece = lambda *a: (hold.wait(60), copy(*a))[1]
            try:
                ckpt.save(state(), os.path.join(OUT, "w.pt"))
                signal_when_blocked("wait_all")
                step()  # the pre-hook waits for the copies of the optimizer's tensors
            finally:
                del ckpt._engine._copy_piece
    finally:
        ckpt._engine._stager._handle = _stage


def main() -> None:
    global armed
    armed = True  # every lock the main thread takes in these cycles: a signal while it is held
    for i in range(4):
        (held_cycle if i % 2 else cycle)(i)
    armed = False
    print(f"FIRED {len(results)} " + " ".join(seen), flush=True)
    assert not bad, bad
    for name in ("handle.wait", "ckpt.wait", "guard"):
        print(f"ARMED {name}", flush=True)
        n = len(results)
        wait_window(name)
        assert len(results) == n + 1, f"{name}: the signal never fired"
        assert results[-1].startswith("same") and not results[-1].endswith("depth=0"), results[-1]
        print(f"OK {name} {results[-1]}", flush=True)
    ckpt.close()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
