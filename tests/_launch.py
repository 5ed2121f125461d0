"""The one launcher of the multi-process tests: N rank processes of a worker script, their env,
their per-rank result JSON (see ``_worker.py`` for the worker side), a kill on timeout."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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
        subprocess.Popen(
            [sys.executable, str(worker), scenario, str(r), str(world), port, str(workdir)],
            env=rank_env(env, drop_env),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(world)
    ]
    stuck = "ranks" if who == "rank" else "processes"
    outputs = wait_all(procs, timeout, f"{scenario}: {stuck} still running")
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
