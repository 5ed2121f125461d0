"""lazyckpt.accelerate in 2 processes on CPU (gloo): ``accelerate launch`` to train and save lazily,
``notebook_launcher`` with a stock Accelerator (no lazyckpt) to restore."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("accelerate")
import torch  # noqa: E402

from _launch import free_port  # noqa: E402

HERE = Path(__file__).resolve().parent
SCRIPTS = HERE / "accelerate_scripts"
from accelerate_scripts import acc_common as C  # noqa: E402

pytestmark = pytest.mark.integration


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [env.get("PYTHONPATH", ""), str(C.SRC), str(C.TESTS)] if p)
    env["OMP_NUM_THREADS"] = "1"
    env["GLOO_SOCKET_IFNAME"] = "lo"
    env["MASTER_ADDR"] = "127.0.0.1"
    env.pop("ACCELERATE_CONFIG_FILE", None)
    return env


def _run(cmd, timeout=240):
    r = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{cmd}\n--- stdout\n{r.stdout[-4000:]}\n--- stderr\n{r.stderr[-6000:]}"
    return r


@pytest.mark.slow(reason="two Accelerate processes save, two more restore with stock")
def test_two_processes_lazy_save_then_stock_restore(tmp_path):
    launch = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
        "--main_process_ip",
        "127.0.0.1",
        "--main_process_port",
        str(free_port()),
    ]
    _run(launch + [str(SCRIPTS / "mp_train_save.py"), str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["num_processes"] == 2 and summary["distributed_type"].endswith("MULTI_CPU")

    # same files as stock for the same setup: shared files once (main process), one RNG file per process
    assert summary["lazy_explicit"] == summary["stock_explicit"]
    assert {
        "random_states_0.pkl",
        "random_states_1.pkl",
        "model.safetensors",
        "optimizer.bin",
        "scheduler.bin",
        "custom_checkpoint_0.pkl",
    } == set(summary["stock_explicit"])
    # automatic naming with total_limit=2: iterations 0-1 went to the explicit folders, 2-6 to
    # checkpoint_2..checkpoint_6; stock deletes the oldest and keeps the last two
    assert summary["kept"] == ["checkpoint_5", "checkpoint_6"]
    for files in summary["kept_files"].values():
        assert files == summary["stock_explicit"]

    folder = tmp_path / "proj" / "checkpoints" / summary["expected_folder"]
    _run([sys.executable, str(SCRIPTS / "mp_stock_load.py"), str(tmp_path), str(folder), str(free_port())])
    main_models = torch.load(tmp_path / "expected_rank0.pt", weights_only=False)["models"]
    for rank in range(2):
        want = torch.load(tmp_path / f"expected_rank{rank}.pt", weights_only=False)
        got = torch.load(tmp_path / f"loaded_rank{rank}.pt", weights_only=False)
        # the model file is the main process's (BatchNorm buffers differ per process under DDP)
        C.assert_same(got["models"], main_models, f"rank {rank}: models")
        for k in ("opts", "scheds", "customs", "step", "torch_rng", "np_rng"):
            C.assert_same(got[k], want[k], f"rank {rank}: {k}")
        assert got["py_rng"] == want["py_rng"], f"rank {rank}: python RNG"
    r0 = torch.load(tmp_path / "loaded_rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "loaded_rank1.pt", weights_only=False)
    assert not torch.equal(r0["torch_rng"], r1["torch_rng"])  # each process got its own RNG file back
