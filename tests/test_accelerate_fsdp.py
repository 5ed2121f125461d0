"""lazyckpt.accelerate and FSDP ``SHARDED_STATE_DICT`` saves (issue 14), 2 processes.

Accelerate 1.15 refuses FSDP on CPU (``distributed_type`` stays MULTI_CPU), so the CPU tests call
accelerate's own ``save_fsdp_model`` / ``save_fsdp_optimizer`` (what ``save_state`` calls in FSDP
mode) on an FSDP2 model next to a real 2-process gloo ``Accelerator`` with lazyckpt installed, and
restore with accelerate's stock ``load_fsdp_model`` / ``load_fsdp_optimizer``. The real
``save_state`` / ``load_state`` in FSDP mode is the ``gpu``-marked test (unverified without CUDA).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("accelerate")
import torch  # noqa: E402

import _launch  # noqa: E402

HERE = Path(__file__).resolve().parent
WORKER = HERE / "accelerate_scripts" / "fsdp_sharded_worker.py"
DCP_FILES = [".lazyckpt-manifest.json", ".metadata", "__0_0.distcp", "__1_0.distcp"]

pytestmark = pytest.mark.integration


def launch(scenario: str, world: int, workdir: Path, timeout: float = 120) -> list[dict]:
    env = {"ACCELERATE_USE_FSDP": "true"} if scenario == "gpu" else None
    return _launch.launch(
        WORKER, scenario, world, workdir, timeout, env=env, drop_env=("ACCELERATE_CONFIG_FILE",),
        who="process", keep_results=True,
    )  # fmt: skip


def test_fsdp_sharded_saves_are_lazy_and_load_with_stock_accelerate(tmp_path):
    results = launch("routed", 2, tmp_path)
    for r, res in enumerate(results):
        assert res["distributed_type"] == "DistributedType.MULTI_CPU", res
        # writes held: stock dcp.save would have returned with the folders written; ours are empty
        assert res["during"] == {"pytorch_model_fsdp_0": [], "optimizer_0": []}, (r, res["during"])
        assert res["after"] == {"pytorch_model_fsdp_0": DCP_FILES, "optimizer_0": DCP_FILES}, (r, res["after"])
        assert res["out"] == ["optimizer_0", "pytorch_model_fsdp_0"], res["out"]
        assert res["offload_restored"], "the plugin's offload_to_cpu must be as before the call"
        assert res["trained_on"], "training after the save should have changed the model"
        assert res["model_equal"] and res["optim_equal"], res
        # a dcp.save of the user's own is not taken over; after remove(), accelerate's is stock again
        assert ".lazyckpt-manifest.json" not in res["plain"] and ".metadata" in res["plain"], res["plain"]
        assert ".lazyckpt-manifest.json" not in res["stock"] and ".metadata" in res["stock"], res["stock"]
    # DCP's own reader reads the folder's metadata (the model under accelerate's "model" key)
    import torch.distributed.checkpoint as dcp

    meta = dcp.FileSystemReader(str(tmp_path / "ckpt" / "pytorch_model_fsdp_0")).read_metadata()
    assert any(k.startswith("model.") for k in meta.state_dict_metadata), list(meta.state_dict_metadata)


def test_fsdp_sharded_write_error_reaches_wait_on_every_process(tmp_path):
    results = launch("write_error", 2, tmp_path)
    for r, res in enumerate(results):
        assert res["raised"] == "DistributedSaveError" and res["ranks"] == [1], (r, res)
        assert res["model"] == DCP_FILES, res["model"]
        assert ".metadata" not in res["optimizer"], res["optimizer"]  # never committed


def test_forced_fsdp_save_state_marks_the_folder_until_the_shards_commit(tmp_path):
    """save_state / load_state in FSDP mode, on CPU only by forcing the mode (see the worker)."""
    results = launch("save_state_forced", 2, tmp_path)
    for r, res in enumerate(results):
        assert res["during"] == {"pytorch_model_fsdp_0": [], "optimizer_0": []}, (r, res["during"])
        assert f".lazyckpt-pending-{r}" in " ".join(res["during_out"]), res["during_out"]
        assert f"random_states_{r}.pkl" in res["during_out"], res["during_out"]
        assert not res["complete_during"] and res["complete_after"], res
        assert res["after"] == {"pytorch_model_fsdp_0": DCP_FILES, "optimizer_0": DCP_FILES}, (r, res["after"])
        assert not any(n.startswith(".lazyckpt-pending-") for n in res["out"]), res["out"]
        assert res["model_equal"] and res["optim_equal"], res


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fsdp_save_state_on_gpu_is_lazy_and_load_state_restores(tmp_path):
    """Accelerate enters FSDP mode only on accelerators: save_state / load_state end to end."""
    (res,) = launch("gpu", 1, tmp_path, timeout=300)
    assert res["distributed_type"] == "DistributedType.FSDP", res
    assert res["during"] == {"pytorch_model_fsdp_0": [], "optimizer_0": []}, res["during"]
    assert any(n.startswith(".lazyckpt-pending-") for n in res["during_out"]), res["during_out"]
    one = [".lazyckpt-manifest.json", ".metadata", "__0_0.distcp"]
    assert res["after"] == {"pytorch_model_fsdp_0": one, "optimizer_0": one}, res["after"]
    assert not any(n.startswith(".lazyckpt-pending-") for n in res["out"]), res["out"]
    assert res["model_equal"] and res["optim_equal"], res
