"""The one launcher of the multi-process tests: N rank processes of a worker script, their env,
their per-rank result JSON (see ``_worker.py`` for the worker side), a kill on timeout."""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


def free_port() -> int:
    """A port free now on 127.0.0.1 for a process group's store. Below Linux's ephemeral range
    (32768+), so no connection's own port takes it before the store binds it, and from a range of
    this pytest-xdist worker's own (gw0: 10000-14999, gw1: 15000-19999, ...), so tests running side
    by side never draw the same one."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
    index = int(worker[2:]) if worker[2:].isdigit() else 0
    low = 10000 + 5000 * (index % 4)
    for port in random.Random().sample(range(low, low + 5000), 5000):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {low}-{low + 4999}")


def release_shm(port: str | int | None = None) -> None:
    """Unlink DeepSpeed's CPU all-reduce buffers (``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``,
    ~70 MB per rank, never unlinked when a rank exits): those of the group at ``port`` once its ranks ended;
    with no port, every one of this user's that no live process maps, at least 10 s old (a rank creates and
    maps its buffer at once; its peers wait for it by name)."""
    import glob

    root = "/dev/shm/deepspeed_allreduce_buffer_"
    if port is not None:
        for path in glob.glob(f"{root}{os.getuid()}_*_{port}_*"):
            with contextlib.suppress(OSError):
                os.unlink(path)
        return
    mapped: set[str] = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        with contextlib.suppress(OSError), open(maps) as fh:
            mapped.update(line.split(None, 5)[-1].strip() for line in fh if root in line)
    for path in glob.glob(f"{root}{os.getuid()}_*"):
        with contextlib.suppress(OSError):
            if path not in mapped and time.time() - os.stat(path).st_mtime > 10:
                os.unlink(path)


def rank_env(extra: dict[str, str] | None = None, drop: Sequence[str] = ()) -> dict[str, str]:
    """This process's env for a rank process: one OMP thread, gloo on loopback, quiet c10d logs,
    ``src/`` and ``tests/`` importable; ``extra`` added, ``drop`` removed."""
    env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo", TORCH_CPP_LOG_LEVEL="ERROR", **(extra or {}))
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(SRC), str(TESTS), env.get("PYTHONPATH", "")] if p)
    for name in drop:
        env.pop(name, None)
    return env


def start(cmd: Sequence[str], world: int, env: dict[str, str], **popen) -> list[subprocess.Popen[str]]:
    """``world`` processes of ``cmd`` + [rank], output piped unless ``popen`` says otherwise."""
    popen.setdefault("stdout", subprocess.PIPE)
    popen.setdefault("stderr", subprocess.STDOUT)
    return [subprocess.Popen([*cmd, str(r)], env=env, text=True, **popen) for r in range(world)]


class _Zygote:
    """This pytest process's fork server (``_zygote.py``), started at first use, ended with it."""

    def __init__(self) -> None:
        self.folder = tempfile.mkdtemp(prefix="lazyckpt-zygote-")
        self.path = os.path.join(self.folder, "socket")
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "_zygote.py"), self.path],
                                     env=rank_env(drop=("OMP_NUM_THREADS",)),
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 120)
        line = self.proc.stdout.readline() if ready else ""
        if line.strip() != "READY":
            self.proc.kill()
            raise RuntimeError(f"the fork server did not start: {line!r}")
        atexit.register(self.close)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()  # it SIGKILLs what it started and ends
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        shutil.rmtree(self.folder, ignore_errors=True)

    def spawn(self, argv: Sequence[str], env: dict[str, str], cwd: str | None, stderr: bool) -> Forked:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe() if stderr else (-1, -1)
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(self.path)
            request = {"argv": list(argv), "env": env, "cwd": cwd or os.getcwd()}
            socket.send_fds(conn, [json.dumps(request).encode()], [out_w] + ([err_w] if stderr else []))
        finally:
            os.close(out_w)
            if stderr:
                os.close(err_w)
        proc = Forked(conn, out_r, err_r)
        proc.pid = int(proc._line(120))
        return proc


class Forked:
    """A process the fork server started: the part of ``subprocess.Popen``'s interface the tests use
    (``pid``, ``returncode``, ``communicate``, ``wait``, ``poll``, ``kill``, ``send_signal``)."""

    def __init__(self, conn: socket.socket, out_fd: int, err_fd: int = -1) -> None:
        self.pid, self.returncode = 0, None
        self._conn, self._replies = conn, b""
        self._pipes = {fd: bytearray() for fd in (out_fd, err_fd) if fd >= 0}
        self._open = set(self._pipes)  # pipes not yet at EOF (and not closed)
        self._out_fd, self._err_fd = out_fd, err_fd

    def _line(self, timeout: float | None) -> str:
        """The fork server's next line on this process's connection (subprocess.TimeoutExpired)."""
        while b"\n" not in self._replies:
            ready, _, _ = select.select([self._conn], [], [], timeout)
            if not ready:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            chunk = self._conn.recv(256)
            if not chunk:
                raise RuntimeError(f"the fork server closed the connection of process {self.pid}")
            self._replies += chunk
        line, self._replies = self._replies.split(b"\n", 1)
        return line.decode()

    def _status(self, timeout: float | None) -> None:
        if self.returncode is None:
            self.returncode = int(self._line(timeout))
            self._conn.close()

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """Its output until EOF (it and every process it started closed the pipes), then its exit code:
        (stdout, stderr), stderr None where it went to stdout."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._open:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, _, _ = select.select(list(self._open), [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0)
            for fd in ready:
                chunk = os.read(fd, 1 << 16)
                if chunk:
                    self._pipes[fd] += chunk
                else:
                    os.close(fd)
                    self._open.discard(fd)
        self._status(None if deadline is None else max(0.01, deadline - time.monotonic()))
        out = self._pipes[self._out_fd].decode(errors="replace")
        err = self._pipes[self._err_fd].decode(errors="replace") if self._err_fd >= 0 else None
        return out, err

    def wait(self, timeout: float | None = None) -> int:
        self._status(timeout)
        assert self.returncode is not None
        return self.returncode

    def poll(self) -> int | None:
        try:
            self._status(0.0)
        except subprocess.TimeoutExpired:
            pass
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def __del__(self) -> None:
        for fd in getattr(self, "_open", ()):
            try:
                os.close(fd)
            except OSError:
                pass


_zygote: _Zygote | None = None


def python(
    argv: Sequence[str], env: dict[str, str], cwd: str | None = None, stderr: bool = False
) -> Forked | subprocess.Popen[str]:
    """``python argv...`` (a script and its arguments) with ``env``, its stdout and stderr piped
    (together, or apart with ``stderr=True``): forked from this process's fork server
    (``_zygote.py``: torch already imported), or a plain subprocess with ``LAZYCKPT_TEST_FORK=0``."""
    global _zygote
    if os.environ.get("LAZYCKPT_TEST_FORK", "1") == "0":
        return subprocess.Popen([sys.executable, *argv], env=env, cwd=cwd, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE if stderr else subprocess.STDOUT, text=True)  # fmt: skip
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = _Zygote()
    return _zygote.spawn(argv, env, cwd, stderr)


def run_python(argv: Sequence[str], env: dict[str, str], timeout: float, cwd: str | None = None,
               check: bool = False) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``subprocess.run([sys.executable, *argv], capture_output=True, text=True, timeout=...)``
    through ``python``: killed at ``timeout`` (subprocess.TimeoutExpired), stdout and stderr apart."""
    proc = python(argv, env, cwd, stderr=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    done = subprocess.CompletedProcess([sys.executable, *argv], proc.returncode or 0, out, err or "")
    if check:
        done.check_returncode()
    return done


def wait_all(procs: Sequence[subprocess.Popen[str]], timeout: float, what: str) -> list[str]:
    """Each process's output; all killed (and an AssertionError) once ``timeout`` s have passed."""
    deadline = time.monotonic() + timeout
    outputs = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise AssertionError(f"{what} after {timeout} s") from None
        outputs.append(out or "")
    return outputs


def launch(
    worker: Path,
    scenario: str,
    world: int,
    workdir: Path,
    timeout: float = 90,
    expect_dead: tuple[int, ...] = (),
    env: dict[str, str] | None = None,
    drop_env: Sequence[str] = (),
    who: str = "rank",
    keep_results: bool = False,
) -> list[dict]:
    """Run ``worker SCENARIO RANK WORLD PORT WORKDIR`` on ``world`` ranks; return each rank's
    result JSON (None for ranks in ``expect_dead``, which must write none)."""
    port = str(free_port())
    procs = [
        python([str(worker), scenario, str(r), str(world), port, str(workdir)], rank_env(env, drop_env))
        for r in range(world)
    ]
    stuck = "ranks" if who == "rank" else "processes"
    try:
        outputs = wait_all(procs, timeout, f"{scenario}: {stuck} still running")
    finally:
        release_shm(port)
    results: list[dict | None] = []
    for r in range(world):
        path = workdir / f"result-{r}.json"
        if r in expect_dead:
            assert not path.exists(), f"{who} {r} was expected to die"
            results.append(None)
            continue
        assert path.exists(), f"{who} {r} wrote no result (rc={procs[r].returncode}):\n{outputs[r][-6000:]}"
        res = json.loads(path.read_text())
        assert res["ok"], f"{who} {r}: {res.get('traceback') or res}\n--- output\n{outputs[r][-4000:]}"
        results.append(res)
        if not keep_results:
            path.unlink()
    return results  # type: ignore[return-value]


@contextlib.contextmanager
def one_rank_group() -> Iterator[None]:
    """A 1-rank gloo process group in this process (for in-process distributed tests)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def run_session(args: Sequence[str], timeout: float, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """Run ``python *args`` (and the processes it starts: Lightning's DDP launcher) in a session of
    its own, output captured; the whole session is SIGKILLed at ``timeout`` (Lightning's SIGTERM
    handler does not end a rank waiting in a collective), then an AssertionError."""
    import signal

    proc = subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{args[0]} still running after {timeout} s:\n{out[-4000:]}") from None
    return subprocess.CompletedProcess(list(args), proc.returncode, out, None)
