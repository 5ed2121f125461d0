"""LazyCheckpointIO under strategy="ddp" (and FSDP with a full state dict) with 2 gloo processes on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest

pytest.importorskip("lightning")

from lightning_scripts.tiny_gpt import assert_same, load  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(TESTS, "lightning_scripts", "ddp_fit.py")

pytestmark = [pytest.mark.integration]


def _run(tmp_path: Any, mode: str) -> list[dict[str, Any]]:
    env = dict(
        os.environ,
        # tests/ for lightning_scripts and _util, the repository root for benchmarks.gpt
        PYTHONPATH=os.pathsep.join(p for p in [TESTS, os.path.dirname(TESTS), os.environ.get("PYTHONPATH", "")] if p),
    )
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, SCRIPT, str(tmp_path), mode], env=env, capture_output=True, text=True,
                          timeout=240)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]


def _check(tmp_path: Any, reports: list[dict[str, Any]]) -> None:
    rank0, rank1 = reports
    # Only rank 0 reaches CheckpointIO: rank 1 never saved, so it never waited on I/O it did not do.
    assert rank0["saves"] >= rank0["global_step"] and rank0["stats"] == rank0["saves"]
    assert rank1["saves"] == 0 and rank1["stats"] == 0 and not rank1["created_checkpointer"]
    files = sorted(os.listdir(tmp_path / "ck"))  # top-2 + last, older files deleted by ModelCheckpoint
    assert "last.ckpt" in files and len(files) == 3 and set(files) <= set(os.listdir(tmp_path / "expected"))
    for name in files:
        assert_same(load(str(tmp_path / "expected" / name)), load(str(tmp_path / "ck" / name)), name)


@pytest.mark.slow(reason="a two-process Lightning DDP fit, stock and lazy")
@pytest.mark.timeout(300)
def test_ddp_two_gloo_processes(tmp_path: Any) -> None:
    _check(tmp_path, _run(tmp_path, "ddp"))


@pytest.mark.gpu  # Lightning's FSDPStrategy refuses accelerator="cpu"
@pytest.mark.timeout(300)
def test_fsdp_full_state_dict_two_processes(tmp_path: Any) -> None:
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    _check(tmp_path, _run(tmp_path, "fsdp"))
