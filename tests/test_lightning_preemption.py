"""Lightning under preemption, with real signals to a real fit: the SLURM auto-requeue checkpoint (saved
inside Lightning's SIGUSR1 handler, also while the main thread is inside lazyckpt) and the SIGTERM path's
``OnExceptionCheckpoint`` are durable when their save returns; the process SIGKILLed at that moment
resumes from them with stock Lightning."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from tests import _launch  # noqa: E402

pytestmark = pytest.mark.integration

SCRIPT = Path(__file__).parent / "lightning_scripts" / "preempt.py"
AT = 3
SLURM = {"SLURM_NTASKS": "1", "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "lazyckpt-test", "SLURM_PROCID": "0",
         "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NODELIST": "localhost"}  # fmt: skip


@pytest.mark.filterwarnings("ignore:.*LeafSpec.* is deprecated:FutureWarning")  # Lightning, torch
@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`:UserWarning")  # stock resume's notes
@pytest.mark.filterwarnings("ignore:You're resuming from a checkpoint that ended before the epoch:UserWarning")
@pytest.mark.parametrize(
    ("mode", "name"),
    [("slurm", "hpc_ckpt_1.ckpt"), ("slurm-inside", "hpc_ckpt_1.ckpt"), ("sigterm", "on_exception.ckpt")],
)
def test_the_preemption_checkpoint_is_durable_when_its_save_returns(tmp_path: Path, mode: str, name: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    if mode.startswith("slurm"):
        env.update(SLURM)
    done = _launch.run_python([str(SCRIPT), mode, str(tmp_path), str(AT)], env, timeout=180)
    assert "SAVED" in done.stdout, done.stdout + done.stderr[-4000:]
    assert done.returncode == -signal.SIGKILL, (done.returncode, done.stderr[-4000:])
    path = tmp_path / name
    assert path.is_file(), sorted(p.name for p in tmp_path.iterdir())
    state = torch.load(path, weights_only=False)
    assert state["global_step"] == AT
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary file was left"
    # stock Lightning resumes from it
    trainer = L.Trainer(
        default_root_dir=tmp_path / "resumed", accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
        enable_model_summary=False, enable_checkpointing=False, max_steps=AT + 2,
    )  # fmt: skip
    trainer.fit(BoringModel(), ckpt_path=str(path))
    assert trainer.global_step == AT + 2
