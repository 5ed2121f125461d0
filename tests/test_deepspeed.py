"""lazyckpt.deepspeed on real DeepSpeed engines: 2 CPU processes (gloo, ``DS_ACCELERATOR=cpu``), ZeRO 0-3.

Each pattern runs stock and lazy with the same seed where it compares: the same tags, file names, tensors and
``latest``; stock ``load_checkpoint`` and ``zero_to_fp32`` read a lazy folder as a stock one. Faults: ENOSPC on
one rank, a stale tensor, SIGKILL right after ``save_checkpoint`` returns and inside a rank's write.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch

pytest.importorskip("deepspeed")

import _launch  # noqa: E402
from _util import assert_same  # noqa: E402

WORKER = Path(__file__).parent / "deepspeed_scripts" / "ds_worker.py"


def _run(scenario: str, workdir: Path, timeout: float = 180, expect_dead: tuple[int, ...] = (), **config) -> list:
    workdir.mkdir(parents=True, exist_ok=True)
    config.setdefault("out", str(workdir / "ckpt"))
    env = {"LAZYCKPT_TEST_DS": json.dumps(config), "DS_ACCELERATOR": "cpu"}
    return _launch.launch(WORKER, scenario, 2, workdir, timeout=timeout, expect_dead=expect_dead, env=env)


def _plain(obj):
    """Loaded checkpoint contents as plain data: objects without their own ``==`` become (type, vars)."""
    if isinstance(obj, dict):
        return {k: _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_plain(v) for v in obj)
    if hasattr(obj, "__dict__") and type(obj).__eq__ is object.__eq__ and not isinstance(obj, type):
        return (type(obj).__qualname__, _plain(vars(obj)))
    return obj


def _same_folders(lazy: Path, stock: Path) -> None:
    names = sorted(str(p.relative_to(stock)) for p in stock.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(lazy)) for p in lazy.rglob("*") if p.is_file()) == names
    for name in names:
        if name.endswith(".pt"):
            got = torch.load(lazy / name, weights_only=False)
            want = torch.load(stock / name, weights_only=False)
            assert_same(_plain(got), _plain(want), name)
        else:
            assert (lazy / name).read_bytes() == (stock / name).read_bytes(), name


@pytest.mark.slow(reason="two 2-process DeepSpeed runs per stage, then a stock load of each")
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_lazy_folders_equal_stock_and_load_with_stock_deepspeed(tmp_path, stage):
    stock = _run("save", tmp_path / "stock", stage=stage, mode="stock")
    lazy = _run("save", tmp_path / "lazy", stage=stage, mode="lazy")
    for s, z in zip(stock, lazy, strict=True):
        assert z["listing"] == s["listing"] and z["latest"] == s["latest"] == "custom"
        assert z["probe3"] == s["probe3"] and z["probe5"] == s["probe5"]  # the same training
    assert stock[0]["latest_after_save_returns"] == "global_step3"
    assert lazy[0]["latest_after_save_returns"] is None  # written once the folder is in place, not before
    _same_folders(tmp_path / "lazy" / "ckpt", tmp_path / "stock" / "ckpt")
    for r in _run("load", tmp_path / "load", stage=stage, mode="stock", out=str(tmp_path / "lazy" / "ckpt")):
        assert r["latest_probe"] == lazy[0]["probe5"] and r["latest_client"] == 5
        assert r["step3_probe"] == lazy[0]["probe3"] and r["step3_client"] == 3
    if stage >= 2:
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        for tag in ("global_step3", "custom"):
            got = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "lazy" / "ckpt"), tag=tag)
            want = get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "stock" / "ckpt"), tag=tag)
            assert_same(dict(got), dict(want), tag)


@pytest.mark.slow(reason="two 2-process DeepSpeed runs with an MoE layer, then a stock load")
@pytest.mark.parametrize(("stage", "ep"), [(0, 2), (2, 1)])
def test_moe_expert_files_equal_stock_and_load_with_stock(tmp_path, stage, ep):
    """DeepSpeed's MoE files (``layer_L_expert_E_...``, ``expp_rank_R_...`` optimizer states): experts split over
    both ranks (``ep`` 2), or each rank holding both (``ep`` 1, ZeRO-2)."""
    stock = _run("save", tmp_path / "stock", stage=stage, mode="stock", moe=ep)
    lazy = _run("save", tmp_path / "lazy", stage=stage, mode="lazy", moe=ep)
    assert any("expert" in n for n in stock[0]["listing"]), stock[0]["listing"]
    for s, z in zip(stock, lazy, strict=True):
        assert z["listing"] == s["listing"] and z["probe5"] == s["probe5"]
    _same_folders(tmp_path / "lazy" / "ckpt", tmp_path / "stock" / "ckpt")
    loaded = _run("load", tmp_path / "load", stage=stage, mode="stock", moe=ep, out=str(tmp_path / "lazy" / "ckpt"))
    for r, z in zip(loaded, lazy, strict=True):
        assert r["latest_probe"] == z["probe5"] and r["step3_probe"] == z["probe3"]


@pytest.mark.slow(reason="two 2-process pipeline runs, then a stock load of each")
def test_pipeline_layer_files_equal_stock_and_load_with_stock(tmp_path):
    stock = _run("pipe_save", tmp_path / "stock", mode="stock")
    lazy = _run("pipe_save", tmp_path / "lazy", mode="lazy")
    assert "global_step2/layer_04-model_states.pt" in stock[0]["listing"], stock[0]["listing"]
    assert [r["listing"] for r in lazy] == [r["listing"] for r in stock]
    _same_folders(tmp_path / "lazy" / "ckpt", tmp_path / "stock" / "ckpt")
    got = _run("pipe_load", tmp_path / "load-lazy", mode="stock", out=str(tmp_path / "lazy" / "ckpt"))
    want = _run("pipe_load", tmp_path / "load-stock", mode="stock", out=str(tmp_path / "stock" / "ckpt"))
    assert [(r["loss"], r["global_steps"]) for r in got] == [(r["loss"], r["global_steps"]) for r in want]
    assert got[0]["global_steps"] == 2


@pytest.mark.slow(reason="two 2-process DeepSpeed runs per stage")
@pytest.mark.parametrize("stage", [2, 3])
def test_exclude_frozen_parameters_saves_what_stock_saves(tmp_path, stage):
    stock = _run("save", tmp_path / "stock", stage=stage, mode="stock", frozen=True)
    lazy = _run("save", tmp_path / "lazy", stage=stage, mode="lazy", frozen=True)
    for s, z in zip(stock, lazy, strict=True):
        assert z["listing"] == s["listing"] and z["probe5"] == s["probe5"]
    _same_folders(tmp_path / "lazy" / "ckpt", tmp_path / "stock" / "ckpt")
    name = "mp_rank_00_model_states.pt" if stage < 3 else "zero_pp_rank_0_mp_rank_00_model_states.pt"
    module = torch.load(tmp_path / "lazy" / "ckpt" / "global_step3" / name, weights_only=False)["module"]
    assert not any(k.startswith("0.") for k in module or {}), sorted(module or {})  # the frozen layer left out


@pytest.mark.slow(reason="two 2-process DeepSpeed runs with gradient accumulation")
def test_gradient_accumulation_commits_at_the_boundary_with_the_state_at_save(tmp_path):
    stock = _run("save", tmp_path / "stock", stage=2, mode="stock", accum=3)
    lazy = _run("save", tmp_path / "lazy", stage=2, mode="lazy", accum=3)
    assert lazy[0]["probe5"] == stock[0]["probe5"]
    _same_folders(tmp_path / "lazy" / "ckpt", tmp_path / "stock" / "ckpt")


def test_a_load_right_after_a_save_in_the_same_process_reads_it(tmp_path):
    r0, r1 = _run("resume_same_process", tmp_path, stage=2)
    assert r0["same"] and r1["same"]
    assert r0["loaded"].endswith("again/mp_rank_00_model_states.pt")


def test_a_second_engine_of_the_process_loads_what_the_first_saved_before_its_step(tmp_path):
    for r in _run("second_engine_loads", tmp_path, stage=2):
        assert r["loaded"] == "t1" and r["same"] and r["same_by_tag"] and r["converted"], r


@pytest.mark.slow(reason="a 2-process DeepSpeed run, then stock loads")
def test_a_save_before_the_first_step_is_written_when_it_returns_as_stock(tmp_path):
    """No step() would commit it (an export, a conversion, DeepSpeed's frozen- and shared-weights tests)."""
    for r in _run("save_before_step", tmp_path, stage=2):
        assert r["raised_None"] == r["raised_"] == "ValueError", r
        assert r["model_keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"] and r["size"] > 0, r
        assert r["fp32_equal"] and r["lazy_after_step"] and r["published"], r


def test_a_save_checkpoint_that_raises_is_never_published_later(tmp_path):
    for r in _run("save_raises", tmp_path, stage=2):
        assert r["raised"] == "RuntimeError", r
        assert r["latest"] == "global_step2" and "global_step3" not in r["listing"], r
        assert not any(".lazyckpt-dist-" in name for name in r["listing"]), r


def test_a_save_from_a_signal_handler_inside_lazyckpt_is_written_at_once_and_keeps_latest(tmp_path):
    for r in _run("reentered_save", tmp_path, stage=2):
        assert r["latest_on_return"] == "sync" and "mp_rank_00_model_states.pt" in r["sync_files"], r
        assert r["latest"] == "sync" and "lazy3" in r["listing"], r  # the older tag published, latest kept


@pytest.mark.parametrize("rank", [1, 0])
def test_enospc_on_one_rank_fails_every_rank_and_keeps_latest(tmp_path, rank):
    """Rank 1 writes one file of the tag; rank 0 two (the model states, then its optimizer file), each one's failure
    known before the next is saved: that earlier file's error fails the tag on every rank at its commit, never
    raised by rank 0's save_checkpoint alone (DeepSpeed's barrier there would then break on the other rank)."""
    for r in _run("enospc", tmp_path, stage=2, enospc_rank=rank, settle_each=True):
        assert r["raised"] == "DistributedSaveError" and r["ranks"] == [rank], r
        assert "No space left" in r["message"], r["message"]
        assert r["latest"] == "global_step2"
        assert [n for n in r["listing"] if n.startswith("global_step")] == ["global_step2"], r["listing"]
        assert not [n for n in r["listing"] if n.startswith(".")], r["listing"]


def test_a_tensor_changed_before_its_copy_fails_the_save_on_every_rank(tmp_path):
    r0, r1 = _run("stale", tmp_path, stage=2)
    assert r0["raised"] == r1["raised"] == "DistributedSaveError", (r0, r1)
    assert r0["cause"] == "StaleTensorError", r0
    assert "stale" not in r0["listing"] and not [n for n in r0["listing"] if n.startswith(".")], r0["listing"]


@pytest.mark.slow(reason="a 2-process DeepSpeed run, then a stock load")
@pytest.mark.parametrize("end", ["destroy", "exit"])
def test_the_last_save_of_a_run_is_published_by_destroy_or_at_exit(tmp_path, end):
    r0, _ = _run("final_save", tmp_path / "run", stage=3, end=end)
    assert r0["latest"] == "global_step3"
    (r,) = {json.dumps(x["latest_probe"]) for x in _run("load", tmp_path / "load", stage=3, mode="stock",
                                                          out=str(tmp_path / "run" / "ckpt"), tag3=False)}  # fmt: skip
    assert json.loads(r) == r0["probe3"]


def test_save_16bit_model_between_a_save_and_its_commit(tmp_path):
    r0, r1 = _run("sixteen_bit", tmp_path, stage=2)
    assert r0["same"], r0
    assert r0["latest"] == r1["latest"] == "global_step2"


def test_a_rank_dead_after_its_save_fails_the_survivor_within_seconds(tmp_path):
    (r0, _) = _run("peer_dies", tmp_path, stage=2, expect_dead=(1,))
    assert r0["raised"] == "DistributedSaveError" and r0["ranks"] == [1], r0
    assert r0["waited_s"] < 30, r0["waited_s"]  # the heartbeat, not commit_timeout (60 s)
    assert r0["latest"] == "global_step2" and "global_step3" not in r0["listing"], r0


def _load_latest_with_stock(tmp_path: Path, out: Path) -> list:
    return _run("load_latest", tmp_path / "load", stage=2, mode="stock", out=str(out))


@pytest.mark.slow(reason="a killed 2-process DeepSpeed run, then a stock load")
def test_sigkill_right_after_save_returns_leaves_a_latest_that_loads_whole(tmp_path):
    work = tmp_path / "run"
    _run("kill_after_save", work, stage=2, expect_dead=(0, 1))
    out = work / "ckpt"
    assert (out / "latest").read_text() in ("global_step2", "global_step3")
    assert (out / (out / "latest").read_text()).is_dir()
    tag = (out / "latest").read_text()
    for r in _load_latest_with_stock(tmp_path, out):
        assert r["global_steps"] == int(tag.removeprefix("global_step")), r


@pytest.mark.slow(reason="a killed 2-process DeepSpeed run, then a stock load")
def test_sigkill_between_the_step_and_the_publish_leaves_latest_on_the_previous_tag(tmp_path):
    work = tmp_path / "run"
    _run("kill_before_publish", work, stage=2, expect_dead=(0, 1))
    out = work / "ckpt"
    # read while the tag was handed over (a step ran) and its folder not yet in place: latest is not ahead
    assert [(work / f"latest-before-publish-{r}.txt").read_text() for r in range(2)] == ["global_step2"] * 2
    assert (out / "latest").read_text() == "global_step2" and not (out / "global_step3").exists()
    r0, _ = _load_latest_with_stock(tmp_path, out)
    assert r0["global_steps"] == 2


@pytest.mark.slow(reason="a 2-process DeepSpeed run killed inside a write, then a stock load")
def test_sigkill_inside_a_write_leaves_latest_on_the_previous_whole_tag(tmp_path):
    work = tmp_path / "run"
    work.mkdir()
    env = {"LAZYCKPT_TEST_DS": json.dumps({"stage": 2, "out": str(work / "ckpt")}), "DS_ACCELERATOR": "cpu"}
    port = str(_launch.free_port())
    procs = [
        _launch.python([str(WORKER), "kill_mid_save", str(r), "2", port, str(work)], _launch.rank_env(env))
        for r in range(2)
    ]
    try:
        out1, _ = procs[1].communicate(timeout=120)  # rank 1 dies in its first data write of global_step3
    finally:
        procs[0].kill()
        procs[0].communicate(timeout=60)
        _launch.release_shm(port)
    assert procs[1].returncode == -signal.SIGKILL, out1[-4000:]
    out = work / "ckpt"
    assert (out / "latest").read_text() == "global_step2"
    assert not (out / "global_step3").exists()
    r0, _ = _load_latest_with_stock(tmp_path, out)
    assert r0["global_steps"] == 2


# -- levels: install(engine, levels=[...]) -------------------------------------------------------------------


def _tags(listing: list[str]) -> list[str]:
    """A save_dir's listing without the recovery scripts but zero_to_fp32.py (which DeepSpeed copies varies)."""
    return [n for n in listing if not n.endswith(".py") or n == "zero_to_fp32.py"]


@pytest.mark.slow(reason="a 2-process DeepSpeed run with levels, then stock loads of each level")
@pytest.mark.parametrize("stage", [2, 3])
def test_levels_each_hold_their_due_tags_and_load_with_stock(tmp_path, stage):
    """fast (every=1, keep=2) and slow (every=2, keep=2), a save every step for 5 steps: fast holds steps 4-5,
    slow 2 and 4, each with its own ``latest`` and DeepSpeed's recovery script; the slow level's files are the
    fast level's bytes; stock engines load each level's newest tag with the state it had; latest(levels) is
    the fast level's step 5. The save_dir given to save_checkpoint is not used."""
    base = tmp_path / "levels"
    r0, r1 = _run("levels", tmp_path / "run", stage=stage, levels_base=str(base))
    fast, slow = base / "fast", base / "slow"
    for r in (r0, r1):
        assert _tags(r["listings"][0]) == ["global_step4", "global_step5", "latest", "zero_to_fp32.py"], r
        assert _tags(r["listings"][1]) == ["global_step2", "global_step4", "latest", "zero_to_fp32.py"], r
        assert r["found"] == [str(fast), 5, 0] and not r["unused"], r
    assert (fast / "latest").read_text() == "global_step5" and (slow / "latest").read_text() == "global_step4"
    names = sorted(p.name for p in (fast / "global_step4").iterdir())
    assert names == sorted(p.name for p in (slow / "global_step4").iterdir()) and len(names) >= 3, names
    for name in names:
        assert (fast / "global_step4" / name).read_bytes() == (slow / "global_step4" / name).read_bytes(), name
    for script in (n for n in r0["listings"][0] if n.endswith(".py")):  # DeepSpeed's recovery scripts
        assert (fast / script).read_bytes() == (slow / script).read_bytes(), script
    loaded, _ = _run("levels_load", tmp_path / "load", stage=stage, levels_base=str(base))
    assert loaded["loaded"] == {"5": [r0["probes"]["5"], 5], "4": [r0["probes"]["4"], 4]}
    assert loaded["found"] == [str(fast), 5, 0]


@pytest.mark.slow(reason="a 2-process DeepSpeed run with levels")
def test_retention_never_removes_the_tag_latest_names(tmp_path):
    """Steps 4 and 5 saved with save_latest=False: the fast level (keep=2) keeps global_step3 beside them, since
    its ``latest`` still names it; latest(levels) finds it."""
    base = tmp_path / "levels"
    for r in _run("levels", tmp_path / "run", stage=2, levels_base=str(base), no_latest_from=4):
        assert _tags(r["listings"][0]) == ["global_step3", "global_step4", "global_step5", "latest", "zero_to_fp32.py"]
        assert _tags(r["listings"][1]) == ["global_step2", "global_step4", "latest", "zero_to_fp32.py"], r
        assert r["found"] == [str(base / "fast"), 3, 0], r
    assert (base / "slow" / "latest").read_text() == "global_step2"


def test_a_signal_handlers_save_inside_the_hand_over_of_the_open_tag_does_not_wait_for_itself(tmp_path):
    """The hand-over is a reentry region: a save from a handler that interrupted it sees lazyckpt re-entered, and
    the hand-over it starts of the same tag returns instead of waiting for the interrupted frame (it hung)."""
    for r in _run("handover_reentered", tmp_path / "run"):
        assert r["reentered"] and not r["hung"], r


@pytest.mark.slow(reason="a 2-process DeepSpeed run with levels")
def test_a_failed_removal_of_an_old_tag_fails_no_later_save(tmp_path):
    """Rank 0 (the owner of both shared levels) cannot delete the tags retention drops (EBUSY, injected): each
    is renamed away (its name free) and the failure logged; no later save_checkpoint fails on rank 0 alone
    (which would fail its tag on every rank), every step is saved, and the levels' visible tags are as usual."""
    base = tmp_path / "levels"
    for r in _run("levels", tmp_path / "run", stage=2, levels_base=str(base), fail_remove=True):
        visible = [n for n in _tags(r["listings"][0]) if not n.startswith(".")]
        assert visible == ["global_step4", "global_step5", "latest", "zero_to_fp32.py"], r
        assert r["found"] == [str(base / "fast"), 5, 0], r


@pytest.mark.slow(reason="a 2-process DeepSpeed run with levels")
def test_a_slower_levels_failed_copy_is_one_level_error_on_every_rank_and_the_fast_level_goes_on(tmp_path):
    """Rank 1's copy of step 2 into the slow level fails (ENOSPC, injected): every rank's wait() raises one
    DistributedLevelError naming level 1 and rank 1; the slow level never shows step 2 (no ``latest`` then),
    step 4 reaches it; the fast level has every step as without the fault."""
    base = tmp_path / "levels"
    for r in _run("levels", tmp_path / "run", stage=2, levels_base=str(base), fail_copy=True):
        raised = r["raised"]
        assert raised is not None and raised["type"] == "DistributedLevelError", r
        assert raised["level"] == 1 and raised["ranks"] == [1] and "No space left" in raised["message"], raised
        assert _tags(r["listings"][0]) == ["global_step4", "global_step5", "latest", "zero_to_fp32.py"], r
        assert _tags(r["listings"][1]) == ["global_step4", "latest", "zero_to_fp32.py"], r
    assert (base / "slow" / "latest").read_text() == "global_step4"


@pytest.mark.slow(reason="a 2-process DeepSpeed run with levels")
def test_a_slower_levels_copy_runs_on_its_thread_while_the_fast_level_goes_on_and_pins_its_source(tmp_path):
    """Every rank's copy of global_step2 into the slow level is held until the fast level (keep=1) has published
    global_step3 and applied its keep: global_step3 comes (the copy is not on the fast level's commit path), and
    global_step2 is still there for the copy (pinned; without the pin, keep=1 drops it first); it goes after.
    The slow level then holds steps 2 and 4, the fast level step 4."""
    base = tmp_path / "levels"
    for r in _run("levels_held", tmp_path / "run", stage=2, levels_base=str(base)):
        assert r["held"] and r["source_there"], r
        assert _tags(r["listings"][0]) == ["global_step4", "latest", "zero_to_fp32.py"], r
        assert _tags(r["listings"][1]) == ["global_step2", "global_step4", "latest", "zero_to_fp32.py"], r
    for name in os.listdir(base / "slow" / "global_step2"):
        assert (base / "slow" / "global_step2" / name).stat().st_size > 0, name


@pytest.mark.slow(reason="a 2-process DeepSpeed run with levels")
def test_a_failed_fast_level_is_one_error_and_the_slower_levels_skip_that_step_alike(tmp_path):
    """Rank 1's write of step 4 fails (ENOSPC) in the fast level: every rank raises that one error (not a
    level error of the slow level, whose copy every rank skips alike); step 5 goes on in the fast level."""
    base = tmp_path / "levels"
    for r in _run("levels_fast_fails", tmp_path / "run", stage=2, levels_base=str(base)):
        assert r["errors"] == [[4, "DistributedSaveError", None]], r
        assert _tags(r["listings"][0]) == ["global_step3", "global_step5", "latest", "zero_to_fp32.py"], r
        assert _tags(r["listings"][1]) == ["global_step2", "latest", "zero_to_fp32.py"], r


@pytest.mark.slow(reason="a 2-process DeepSpeed run with levels, one rank SIGKILLed, then stock loads")
def test_sigkill_inside_a_slower_levels_copy_leaves_its_latest_on_the_previous_whole_tag(tmp_path):
    """Rank 1 dies inside its copy of global_step4 into the slow level, after the fast level published it: the
    survivor's wait() raises DistributedLevelError for level 1 within seconds (the heartbeat), the slow level's
    ``latest`` still names global_step2 and no global_step4 folder is there; stock engines load both levels'
    newest tags whole (fast: step 4, slow: step 2)."""
    base = tmp_path / "levels"
    r0, _ = _run("levels_killed", tmp_path / "run", stage=2, levels_base=str(base), expect_dead=(1,))
    assert r0["raised"] and r0["raised"]["type"] == "DistributedLevelError" and r0["raised"]["level"] == 1, r0
    assert r0["wait_s"] < 30, r0
    fast, slow = base / "fast", base / "slow"
    assert (fast / "latest").read_text() == "global_step4" and (slow / "latest").read_text() == "global_step2"
    assert _tags(sorted(n for n in os.listdir(slow) if not n.startswith("."))) == [
        "global_step2", "latest", "zero_to_fp32.py",
    ]  # fmt: skip
    loaded, _ = _run("levels_load", tmp_path / "load", stage=2, levels_base=str(base))
    assert loaded["loaded"] == {"4": [r0["probes"]["4"], 4], "2": [r0["probes"]["2"], 2]}
    assert loaded["found"] == [str(fast), 4, 0]


@pytest.mark.slow(reason="a 2-process DeepSpeed run with a node-local level, then stock loads of each level")
def test_node_local_levels_hold_each_nodes_tags_and_the_shared_level_one_copy_of_each_file(tmp_path):
    """Each rank a node: its own fast folder, and LOCAL_RANK 0 with DeepSpeed's use_node_local_storage (each node's
    first rank writes the model states). Each node's fast folder holds steps 4-5, its own files with its model
    states, and its own ``latest``; the shared slow level holds steps 2 and 4 with each file once (the model
    states from node 0), the bytes of the fast copies; stock engines on each node load each level's newest tag."""
    base = tmp_path / "levels"
    config = {"stage": 2, "levels_base": str(base), "node_local": True, "node_local_storage": True}
    results = _run("levels", tmp_path / "run", **config)
    for r, res in enumerate(results):
        fast = base / f"rank{r}"
        assert [n for n in res["listings"][0] if not n.endswith(".py")] == ["global_step4", "global_step5", "latest"]
        assert (fast / "latest").read_text() == "global_step5" and res["found"] == [str(fast), 5, 0], res
        assert _tags(res["listings"][1]) == ["global_step2", "global_step4", "latest", "zero_to_fp32.py"], res
    own = [{p.name: p for p in (base / f"rank{r}" / "global_step4").iterdir()} for r in (0, 1)]
    assert all("mp_rank_00_model_states.pt" in files for files in own), own
    slow = base / "slow" / "global_step4"
    assert sorted(p.name for p in slow.iterdir()) == sorted(set(own[0]) | set(own[1]))
    for p in slow.iterdir():
        assert p.read_bytes() == (own[0].get(p.name) or own[1][p.name]).read_bytes(), p.name
    assert (base / "slow" / "latest").read_text() == "global_step4"
    probes = results[0]["probes"]
    for res in _run("levels_load", tmp_path / "load", **config):
        assert res["loaded"] == {"5": [probes["5"], 5], "4": [probes["4"], 4]}, res


@pytest.mark.slow(reason="2-process DeepSpeed runs with a node-local level with replicas, one node's memory wiped")
def test_replicas_bring_a_replaced_nodes_tags_back_and_stock_loads_them(tmp_path):
    """Node-local levels as above, the fast one with replicas=1: each node holds the other's steps 4-5 (keep=2),
    byte-equal to its files. Node 1's memory wiped (a replaced node): latest(levels) on every rank brings its
    global_step5 back from node 0's replica, with its ``latest``; both ranks find step 5 at level 0 and stock
    engines load it with the state it had."""
    base = tmp_path / "levels"
    config = {"stage": 2, "levels_base": str(base), "node_local": True, "node_local_storage": True, "replicas": 1}
    probes = _run("levels", tmp_path / "run", **config)[0]["probes"]
    for r, other in ((0, 1), (1, 0)):
        held = base / f"rank{r}" / "replicas" / f"node-{other:04d}"
        assert sorted(os.listdir(held)) == ["step-00000004", "step-00000005"], os.listdir(held)
        for step in (4, 5):
            primary = base / f"rank{other}" / f"global_step{step}"
            copies = {p.name: p for p in (held / f"step-{step:08d}").iterdir() if not p.name.startswith(".")}
            assert sorted(copies) == sorted(p.name for p in primary.iterdir()), (copies, step)
            assert all(copies[p.name].read_bytes() == p.read_bytes() for p in primary.iterdir())
    wiped = base / "rank1"
    shutil.rmtree(wiped)
    for r, res in enumerate(_run("levels_restore", tmp_path / "restore", **config)):
        assert res["found"] == [str(base / f"rank{r}"), 5, 0], res
        assert res["loaded"] == [probes["5"], 5], res
    assert (wiped / "latest").read_text() == "global_step5"
    held = base / "rank0" / "replicas" / "node-0001" / "step-00000005"
    assert sorted(p.name for p in (wiped / "global_step5").iterdir()) == sorted(
        p.name for p in held.iterdir() if not p.name.startswith(".")
    )


@pytest.mark.slow(reason="a 2-process DeepSpeed run with a node-local level")
def test_a_failed_write_on_one_node_publishes_the_tag_on_no_node(tmp_path):
    """Node-local levels as above; rank 1's write of step 4 fails (ENOSPC): one decision fails the tag on both
    nodes (node 0's folder never shows global_step4 either), every rank raises that one error, and step 5 goes on."""
    base = tmp_path / "levels"
    config = {"stage": 2, "levels_base": str(base), "node_local": True, "node_local_storage": True}
    for r, res in enumerate(_run("levels_fast_fails", tmp_path / "run", **config)):
        assert res["errors"] == [[4, "DistributedSaveError", None]], res
        assert [n for n in res["listings"][0] if not n.endswith(".py")] == ["global_step3", "global_step5", "latest"]
        assert (base / f"rank{r}" / "latest").read_text() == "global_step5"
        assert _tags(res["listings"][1]) == ["global_step2", "latest", "zero_to_fp32.py"], res


@pytest.mark.slow(reason="a 2-process DeepSpeed run with a node-local level")
def test_a_node_that_cannot_publish_leaves_every_nodes_latest_on_the_previous_tag(tmp_path):
    """Node-local levels; node 1's rename of global_step4 fails (ENOSPC): every rank raises one error, and node 0,
    whose folder of step 4 is in place, keeps its ``latest`` on global_step3 (written only once every node's folder
    is in place), so no ``latest`` names a tag another node lacks; step 5 goes on everywhere."""
    base = tmp_path / "levels"
    config = {"stage": 2, "levels_base": str(base), "node_local": True, "node_local_storage": True, "fail_publish": 1}
    for res in _run("levels_fast_fails", tmp_path / "run", **config):
        assert res["errors"] == [[4, "DistributedSaveError", None]], res
        assert res["latest"] == [1, 2, 3, 3, 5], res


@pytest.mark.parametrize("why", ["node_local", "replicas"])
def test_levels_deepspeed_cannot_serve_are_refused_on_every_rank(tmp_path, why):
    """A level folder not every rank sees (each rank its own: node-local) without DeepSpeed's node-local storage,
    or replicas: SaveRefusedError on every rank at install, the stock engine left in place."""
    config = {"node_local": True} if why == "node_local" else {"replicas": 1}
    for r in _run("levels_refused", tmp_path / "run", stage=2, levels_base=str(tmp_path / "levels"), **config):
        assert r["refused"] and ("node-local" in r["refused"] or "replicas" in r["refused"]), r
        assert _tags(r["stock"]) == ["global_step0", "latest", "zero_to_fp32.py"], r


# -- Accelerate with a DeepSpeedPlugin: lazyckpt.accelerate.install(accelerator) -----------------------------


def _engine_files(folder: Path) -> dict[str, Path]:
    return {str(p.relative_to(folder)): p for p in folder.rglob("*") if p.is_file() and "pytorch_model" in p.parts}


@pytest.mark.slow(reason="two 2-process Accelerate + DeepSpeed runs, then stock loads")
def test_accelerate_save_state_with_deepspeed_equals_stock_and_loads_with_stock(tmp_path):
    from lazyckpt.commit.folder import is_complete

    stock = _run("accelerate_save", tmp_path / "stock", stage=2, mode="stock")
    lazy = _run("accelerate_save", tmp_path / "lazy", stage=2, mode="lazy")
    for s, z in zip(stock, lazy, strict=True):
        assert z["probe1"] == s["probe1"] and z["probe2"] == s["probe2"]
        assert z["listing"] == s["listing"]  # the same files: the engine's tag folder, latest, RNG, scripts
    assert lazy[0]["s2_latest_on_return"] is False  # the tag is committed at the next step, latest after it
    for name in ("s1", "s2"):
        got, want = tmp_path / "lazy" / "ckpt" / name, tmp_path / "stock" / "ckpt" / name
        assert is_complete(got)
        assert (got / "latest").read_text() == (want / "latest").read_text() == "pytorch_model"
        files = _engine_files(want)
        assert sorted(_engine_files(got)) == sorted(files) and files
        for rel, path in files.items():
            assert_same(_plain(torch.load(got / rel, weights_only=False)), _plain(torch.load(path, weights_only=False)))
    loaded = _run("accelerate_load", tmp_path / "load", stage=2, mode="stock", out=str(tmp_path / "lazy" / "ckpt"),
                  folder="s2")  # fmt: skip
    for r, z in zip(loaded, lazy, strict=True):
        assert r["probe"] == z["probe2"]


@pytest.mark.slow(reason="a killed 2-process Accelerate + DeepSpeed run, then a stock load")
def test_accelerate_with_deepspeed_sigkill_after_save_state_leaves_the_folder_marked_incomplete(tmp_path):
    from lazyckpt.commit.folder import is_complete, pending_markers

    work = tmp_path / "run"
    _run("accelerate_kill", work, stage=2, mode="lazy", expect_dead=(0, 1))
    s1, s2 = work / "ckpt" / "s1", work / "ckpt" / "s2"
    assert is_complete(s1) and (s1 / "latest").read_text() == "pytorch_model"
    # the tag was never committed (no step after the save): no latest, no tag folder, the markers stay
    assert pending_markers(s2) and not is_complete(s2)
    assert not (s2 / "latest").exists() and not (s2 / "pytorch_model").exists()
    for r in _run("accelerate_load", tmp_path / "load", stage=2, mode="stock", out=str(work / "ckpt"), folder="s1"):
        assert r["ok"], r


# -- the transformers Trainer with deepspeed=: lazyckpt.transformers.install(trainer) -----------------------

TRAINER = Path(__file__).parent / "transformers_scripts" / "ds_trainer.py"


def _trainer(out: Path, mode: str, scenario: str, stage: int, *extra: str, dies: bool = False) -> None:
    port = str(_launch.free_port())
    one = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    env = _launch.rank_env({"DS_ACCELERATOR": "cpu", "STAGE": str(stage), **one})
    proc = _launch.python([str(TRAINER), str(out), mode, scenario, *extra], env)
    try:
        output, _ = proc.communicate(timeout=240)
    finally:
        _launch.release_shm(port)
    assert proc.returncode == (-signal.SIGKILL if dies else 0), output[-6000:]


def _tensors(path: Path):
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(path)
    return _plain(torch.load(path, weights_only=False))


@pytest.mark.slow(reason="stock and lazy Trainer runs with DeepSpeed, then a stock resume of the lazy folder")
@pytest.mark.parametrize("stage", [2, 3])
def test_transformers_trainer_with_deepspeed_equals_stock_and_resumes_with_stock(tmp_path, stage):
    stock, lazy = tmp_path / "stock", tmp_path / "lazy"
    _trainer(stock, "stock", "run", stage)
    _trainer(lazy, "lazy", "run", stage)
    for name in ("checkpoint-2", "checkpoint-4"):
        want, got = stock / name, lazy / name
        names = sorted(str(p.relative_to(want)) for p in want.rglob("*") if p.is_file())
        assert sorted(str(p.relative_to(got)) for p in got.rglob("*") if p.is_file()) == names
        assert (got / "latest").read_text() == (want / "latest").read_text() == f"global_step{name[11:]}"
        for rel in names:
            if rel.endswith((".pt", ".pth", ".safetensors")):
                assert_same(_tensors(got / rel), _tensors(want / rel), rel)
    resumed = tmp_path / "resumed"
    _trainer(resumed, "stock", "resume", stage, str(lazy / "checkpoint-2"))
    want = stock / "checkpoint-4" / "global_step4"
    for path in sorted(want.iterdir()):
        assert_same(_tensors(resumed / "checkpoint-4" / "global_step4" / path.name), _tensors(path), path.name)


@pytest.mark.slow(reason="a Trainer run with DeepSpeed and levels, then a stock resume from the slow level")
def test_transformers_trainer_with_deepspeed_levels_copies_the_whole_folder_with_its_tag(tmp_path):
    run = tmp_path / "run"
    _trainer(run, "lazy", "levels", 2)
    fast, slow = run / "fast", run / "slow"
    assert sorted(p.name for p in fast.iterdir()) == sorted(p.name for p in slow.iterdir()) == ["checkpoint-4"]
    names = sorted(str(p.relative_to(fast)) for p in fast.rglob("*") if p.is_file())
    assert "checkpoint-4/global_step4/mp_rank_00_model_states.pt" in names, names
    assert sorted(str(p.relative_to(slow)) for p in slow.rglob("*") if p.is_file()) == names
    for rel in names:  # the tag folder nested in checkpoint-4 too
        assert (slow / rel).read_bytes() == (fast / rel).read_bytes(), rel
    _trainer(tmp_path / "resumed", "stock", "resume", 2, str(slow / "checkpoint-4"))


@pytest.mark.slow(reason="a Trainer run with DeepSpeed SIGKILLed after a save, then a stock resume")
def test_transformers_trainer_with_deepspeed_sigkill_after_a_save_leaves_only_whole_checkpoints(tmp_path):
    run = tmp_path / "run"
    _trainer(run, "lazy", "kill", 2, dies=True)
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["checkpoint-2"]
    assert (run / "checkpoint-2" / "latest").read_text() == "global_step2"
    _trainer(tmp_path / "resumed", "stock", "resume", 2, str(run / "checkpoint-2"))


@pytest.mark.slow(reason="the example under torchrun, 2 CPU ranks")
def test_the_example_trains_saves_lazily_and_loads_the_newest_tag_back(tmp_path):
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    env = _launch.rank_env({"DS_ACCELERATOR": "cpu"})
    env["PYTHONPATH"] = f"{root}{os.pathsep}{env['PYTHONPATH']}"
    port = _launch.free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(port), "-m", "examples.deepspeed_gpt", "--size", "tiny", "--steps", "2",
           "--dir", str(tmp_path)]  # fmt: skip
    try:
        proc = subprocess.run(cmd, env=env, cwd=root, capture_output=True, text=True, timeout=300)
    finally:
        _launch.release_shm(port)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    assert "loaded back equal to the state at its save: True" in proc.stdout, proc.stdout[-3000:]
