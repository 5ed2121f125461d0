"""The repository's benchmarks (benchmarks/, not shipped in the wheel), in process, at their smallest size."""

from __future__ import annotations

import ast
import json
import os
import sys
from pathlib import Path

import pytest

from benchmarks import bench_core, bench_levels, bench_paired, gpt, probe_copy, probe_tmpfs

SRC = Path(__file__).resolve().parents[1] / "src" / "lazyckpt"


def test_bench_core_json_to_stdout_with_progress_on_stderr(capsys):
    argv = ["--size", "tiny", "--steps", "1", "--rounds", "1", "--warmup", "0", "--modes", "lazyckpt", "--json"]
    assert bench_core.main(argv) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert doc["modes"] == ["none", "lazyckpt"] and "[100%]" in captured.err


def test_bench_core_skips_a_peer_that_is_not_available(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.distributed.checkpoint.staging", None)
    argv = ["--size", "tiny", "--steps", "1", "--rounds", "1", "--warmup", "0", "--modes", "dcp", "--no-progress"]
    assert bench_core.main(argv) == 0
    out = capsys.readouterr().out
    assert "note: dcp skipped" in out and "needs torch>=2.9" in out


def test_bench_core_prints_the_regime_and_the_storage_floor(capsys):
    torch = __import__("torch")
    before = torch.get_num_threads()
    try:
        argv = ["--size", "tiny", "--steps", "2", "--rounds", "1", "--warmup", "0", "--modes", "lazyckpt",
                "--threads", "1", "--no-progress"]  # fmt: skip
        assert bench_core.main(argv) == 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert "1 torch thread(s)" in out and "storage floor:" in out and "of engine cost" in out


def test_storage_floor_splits_the_final_drain_from_the_per_checkpoint_part():
    from benchmarks._baselines import floor_parts, storage_floor

    # a disk faster than the step: only the last write is not hidden (once per run)
    assert floor_parts(1.0, 2.0, 5) == (1.0, 0.0) and storage_floor(1.0, 2.0, 5) == 0.2
    # a disk slower than the step: every write but the last delays the next by disk - step
    assert floor_parts(3.0, 2.0, 5) == (3.0, 0.8) and abs(storage_floor(3.0, 2.0, 5) - 1.4) < 1e-12


@pytest.mark.slow(reason="the levels benchmark's smoke run: every mode trains, then resumes from each level")
def test_bench_levels_trains_every_mode_and_resumes_from_each_level(tmp_path, capsys):
    """All training modes in one run (tiny), then two resume cases in fresh processes; the report
    prints the steady stall apart from the drain, the ratios, the disk's own write, the resume table."""
    torch = __import__("torch")
    before = torch.get_num_threads()
    out = tmp_path / "levels.json"
    argv = ["--size", "tiny", "--steps", "3", "--rounds", "1", "--warmup", "0", "--disk-every", "2", "--threads", "1",
            "--resume-rounds", "1", "--resume-cases", "lazyckpt memory,torch.load disk", "--no-drop-caches",
            "--no-progress", "--out-dir", str(tmp_path / "disk"), "--json", str(out)]  # fmt: skip
    left_before = set(Path("/dev/shm").glob("lazyckpt-levels-*"))  # a killed earlier run's are not this one's
    try:
        assert bench_levels.main(argv) == 0
    finally:
        torch.set_num_threads(before)
    printed = capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["training"]["modes"] == list(bench_levels.MODES)
    levels = doc["training"]["levels"]
    assert set(levels["lazy-mem+disk"]["vs"]) <= {"torch.save", "dcp", "lazy-disk", "lazy-mem"}
    assert levels["disk_write"]["bytes"] > 0
    # the disk level was due within the counted steps (steps numbered from 2 mod 2 + 1)
    assert any((tmp_path / "disk" / "training" / "lazy-mem+disk").glob("step-*.pt"))
    assert sorted(doc["resume"]["summary"]) == ["lazyckpt memory", "torch.load disk"]
    assert doc["resume"]["runs"]["lazyckpt memory"][0]["level"] == 0  # the memory level was the one found
    for text in (
        "steady stall/step s",
        "one-time drain s",
        "vs torch.save",
        "disk: write + fsync",
        "lazy-mem+disk vs lazy-mem",
        "the disk copy's placement",
        "resume:",
        "lazyckpt memory:",
    ):
        assert text in printed, text
    assert set(Path("/dev/shm").glob("lazyckpt-levels-*")) <= left_before  # its memory level was cleaned up


def test_bench_paired_takes_turns_in_blocks_and_reports_each_round(tmp_path, mem, capsys):
    torch = __import__("torch")
    before = torch.get_num_threads()
    os.makedirs(mem)
    try:
        argv = ["--size", "tiny", "--rounds", "2", "--block", "3", "--modes", "lazy-mem,lazy-mem+disk",
                "--dir", str(tmp_path), "--memory-dir", mem]  # fmt: skip
        assert bench_paired.main(argv) == 0
    finally:
        torch.set_num_threads(before)
    out = capsys.readouterr().out
    assert out.count("round 1:") == out.count("round 2:") == 3  # none, lazy-mem, lazy-mem+disk
    assert [ln.split()[0] for ln in out.splitlines() if ln.startswith(("none ", "lazy-mem"))] == [
        "none", "lazy-mem", "lazy-mem+disk"
    ]  # fmt: skip
    assert os.listdir(tmp_path) == [] and not any(n.startswith("bench_paired-") for n in os.listdir(mem))


def test_bench_core_unknown_mode_exits_1(capsys):
    assert bench_core.main(["--modes", "torch.save,nope"]) == 1
    assert "unknown mode" in capsys.readouterr().err


def test_the_gpt_trains_deterministically():
    cfg = gpt.config_for("tiny")
    losses = []
    for _ in range(2):
        model = gpt.build(cfg, seed=0)
        opt = gpt.make_optimizer(model)
        batches = gpt.BatchStream(cfg, seed=0)
        losses.append([float(gpt.train_step(model, opt, batches.next())) for _ in range(2)])
    assert losses[0] == losses[1]
    state = model.state_dict()
    assert state["wte.weight"].data_ptr() == state["lm_head.weight"].data_ptr()  # tied, as in GPT-2


def test_no_model_and_no_benchmark_harness_in_the_package():
    """The wheel ships neither: no nn.Module subclass, no module that imports the benchmarks."""
    for path in SRC.rglob("*.py"):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):
                bases = [ast.unparse(b) for b in node.bases]
                assert not any(b.endswith("Module") for b in bases), f"{path}: class {node.name}({', '.join(bases)})"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
                assert not any(n.split(".")[0] == "benchmarks" for n in names), f"{path} imports {names}"
    assert not list(SRC.glob("cli/_bench*")) and not (SRC / "cli" / "_gpt.py").exists()


def test_probe_tmpfs_times_fresh_and_overwritten_files(tmp_path, capsys):
    assert probe_tmpfs.main(["--bytes", str(3 << 20), "--rounds", "1", "--dir", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert all(case in printed for case in ("fresh+fallocate", "fresh ", "overwrite"))
    assert list(tmp_path.iterdir()) == []  # its folder is gone


def test_probe_copy_runs_every_copy_and_cleans_up(tmp_path, mem, capsys):
    """Every copy mode runs to a file of the source's size (the probe checks it) and the probe leaves
    nothing in either folder."""
    import os
    import re

    torch = __import__("torch")
    before = torch.get_num_threads()
    os.makedirs(mem)
    argv = ["--size", "tiny", "--rounds", "2", "--block", "2", "--bytes", str((17 << 20) + 5)]
    try:
        assert probe_copy.main([*argv, "--src", mem, "--dst", str(tmp_path)]) == 0
    finally:
        torch.set_num_threads(before)  # it sets 1 (a core to spare): the next tests' regime must not change
    printed = capsys.readouterr().out
    assert all(re.search(rf"{mode} +median", printed) for mode in ("lazyckpt", "bounce", "sendfile", "populate"))
    assert list(tmp_path.iterdir()) == [] and os.listdir(mem) == []


def test_placement_ab_forces_each_placement_and_restores_the_rule(mem, monkeypatch):
    """``_modes.write_in_save`` (the lazyckpt-bg and lazy-mem*-bg/-insave modes) really moves the
    memory-filesystem write: inside save() when forced on with a core to spare, to the background
    threads when forced off with every core busy; lazyckpt's own rule is back afterwards."""
    import os
    import threading

    import torch

    from _util import data_writers
    from benchmarks._modes import write_in_save
    from lazyckpt import LazyCheckpointer
    from lazyckpt.core import plan

    writers = data_writers(monkeypatch)
    os.makedirs(mem)
    rule, before = plan.write_in_save, torch.get_num_threads()
    model = torch.nn.Linear(512, 1024)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    try:
        for force, threads in ((True, 1), (False, plan.usable_cpus())):
            torch.set_num_threads(threads)
            writers.clear()
            with LazyCheckpointer() as ckpt, write_in_save(force):
                ckpt.track(opt)
                ckpt.save({"model": model.state_dict(), "optim": opt.state_dict()}, f"{mem}/{force}.pt").wait()
            main = threading.current_thread().name
            assert writers and (set(writers) == {main} if force else main not in writers), (force, writers)
            assert plan.write_in_save is rule
    finally:
        torch.set_num_threads(before)
