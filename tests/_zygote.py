"""A fork server for the tests' worker processes: it imports torch (and torch.distributed's
checkpoint and FSDP modules) once, then forks a fresh process for each script a test runs.

Each rank of a multi-process test is still a process of its own (its own memory, process group,
pid to SIGKILL), started as ``python script.py ARGS`` would start it, without paying the ~2-4 CPU s
of those imports again: on 2 cores that import was most of the suite's multi-process time.

Usage: ``_zygote.py SOCKET`` (``_launch`` starts one per pytest process, with ``rank_env()``'s env
less ``OMP_NUM_THREADS``: a child asking for fewer threads gets them with ``torch.set_num_threads``).
It prints ``READY`` once it listens; it ends when its stdin closes (the pytest process is gone),
SIGKILLing the children it started. A request is one message on a connection to SOCKET: JSON
``{"argv": [script or "-c", ...], "env": {...}, "cwd": ...}`` and one file descriptor, which becomes
the child's stdout and stderr, or two: its stdout, its stderr. The reply on the same connection: the
child's pid, one line, then, when the child has ended, its exit code as ``subprocess`` reports it
(``-9`` for SIGKILL), one line.

Nothing is imported here that starts a thread: a fork copies only the forking thread.
"""

from __future__ import annotations

import json
import os
import runpy
import selectors
import signal
import socket
import sys
import threading
import traceback
import types

PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "safetensors.torch",
)


def _child(request: dict, fds: list[int]) -> None:
    """In the forked process: become ``python argv...`` with the request's env and cwd. The script
    runs as ``__main__`` and the process ends as Python ends one (its exceptions printed, atexit
    handlers and non-daemon threads waited for, KeyboardInterrupt as SIGINT), never returning here."""
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.dup2(fds[0], 1)
        os.dup2(fds[-1], 2)
        for fd in set(fds):
            os.close(fd)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.close(devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        code = request["argv"][1] if request["argv"][0] == "-c" else None
        script = "-c" if code is not None else os.path.abspath(request["argv"][0])
        sys.argv = [script, *request["argv"][2 if code is not None else 1 :]]
        extra = [p for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p and p not in sys.path]
        sys.path[:] = ["" if code is not None else os.path.dirname(script), *extra, *sys.path[1:]]
        if request["env"].get("OMP_NUM_THREADS", "").isdigit():  # OpenMP read the env at our import, without it
            import torch

            torch.set_num_threads(int(request["env"]["OMP_NUM_THREADS"]))
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    if code is None:
        runpy.run_path(script, run_name="__main__")
    else:  # python -c CODE
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(code, "<string>", "exec"), main.__dict__)
    sys.exit(0)


def serve(path: str) -> None:
    for name in PRELOAD:
        try:
            __import__(name)
        except ImportError:
            pass
    if threading.active_count() != 1:
        raise SystemExit(f"a preloaded module started a thread: {threading.enumerate()}")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(server, selectors.EVENT_READ, "accept")
    sel.register(wake_r, selectors.EVENT_READ, "reap")
    sel.register(sys.stdin, selectors.EVENT_READ, "parent")
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection to tell its exit code
    print("READY", flush=True)
    while True:
        for key, _ in sel.select():
            if key.data == "parent" and not os.read(sys.stdin.fileno(), 1 << 12):
                for pid in waiting:  # pytest is gone: no one waits for these
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                return
            if key.data == "accept":
                conn, _ = server.accept()
                msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 2)
                request = json.loads(msg)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    server.close()
                    for other in waiting.values():
                        other.close()
                    conn.close()
                    _child(request, fds)
                for fd in fds:
                    os.close(fd)
                waiting[pid] = conn
                conn.sendall(f"{pid}\n".encode())
            if key.data == "reap":
                try:
                    while os.read(wake_r, 1 << 12):
                        pass
                except BlockingIOError:
                    pass
            while waiting:  # every ended child, whatever woke us (a SIGCHLD may merge several)
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                conn = waiting.pop(pid, None)
                if conn is not None:
                    try:
                        conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                    except OSError:
                        pass
                    conn.close()


if __name__ == "__main__":
    serve(sys.argv[1])
