"""The ``lazyckpt`` command line: ``lazyckpt.cli.main`` in this process (the ``cli`` fixture: its exit
code and what it wrote to file descriptors 1 and 2, a subprocess it starts included), and the entry
points themselves (``python -m lazyckpt``, the console script) in a process of their own.

Missing GPUs and NVML are simulated the way users meet them: ``CUDA_VISIBLE_DEVICES=""`` and a
stand-in ``pynvml`` module first on the import path (absent, failing to start, or reporting a GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from lazyckpt import LazyCheckpointer
from lazyckpt.cli import doctor, main

REPO_SRC = str(Path(__file__).resolve().parents[1] / "src")


def cli_process(*args: str) -> subprocess.CompletedProcess:
    """``python -m lazyckpt ARGS`` in a process of its own: the module entry point."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO_SRC, os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
    return subprocess.run([sys.executable, "-m", "lazyckpt", *args], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip


@pytest.fixture
def cli(capfd, monkeypatch):
    """``cli(*args, env=..., pythonpath=...)``: ``main(args)`` here, as ``python -m lazyckpt`` would run
    it (argparse's exits become the return code), with ``env`` set and ``pythonpath`` first on the
    import path (its modules imported afresh); returns the exit code and the captured output."""

    def run(*args: str, env: dict[str, str] | None = None, pythonpath: Path | None = None):
        for name, value in (env or {}).items():
            monkeypatch.setenv(name, value)
        if pythonpath is not None:  # here, and in the processes it starts (bench)
            paths = [str(pythonpath), REPO_SRC, os.environ.get("PYTHONPATH", "")]
            monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths))
            monkeypatch.syspath_prepend(str(pythonpath))
            for module in os.listdir(pythonpath):
                monkeypatch.delitem(sys.modules, module.removesuffix(".py"), raising=False)
        capfd.readouterr()
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse: --help, --version, usage errors
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(["lazyckpt", *args], code, out, err)

    return run


def _state() -> dict:
    model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
    model[1].weight = model[0].weight  # tied: one storage, two keys
    opt = torch.optim.AdamW(model.parameters())
    model(torch.arange(4)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 7}


class Evil:
    """Unpickling this would create a directory: proof that a command ran code from a file."""

    def __init__(self, target: Path) -> None:
        self.target = str(target)

    def __reduce__(self):
        return (os.mkdir, (self.target,))


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("cli")
    state = _state()
    with LazyCheckpointer(chunk_bytes=4096) as c:
        c.save(state, d / "lazy.pt").wait()
    torch.save(state, d / "stock.pt")
    save_file({"w": torch.randn(4, 3), "h": torch.zeros(5, dtype=torch.bfloat16)}, d / "w.safetensors",
              metadata={"format": "pt"})  # fmt: skip
    lightning = {"epoch": 3, "global_step": 120, "pytorch-lightning_version": "2.6.6", "state_dict": state["model"],
                 "loops": {"fit_loop": {}}, "callbacks": {"ModelCheckpoint{'monitor': None}": {}},
                 "optimizer_states": [state["optim"]], "lr_schedulers": [], "hparams_name": "kwargs",
                 "hyper_parameters": {"lr": 0.1}}  # fmt: skip
    torch.save(lightning, d / "plain.ckpt")
    torch.save({**lightning, "hyper_parameters": {"ns": argparse.Namespace(lr=0.1)}}, d / "hparams.ckpt")
    torch.save({"x": Evil(d / "pwned")}, d / "evil.pt")
    (d / "notes.txt").write_text("not a checkpoint")
    return d


def _corrupt(src: Path, dst: Path, at: float = 0.5) -> Path:
    raw = bytearray(src.read_bytes())
    raw[int(len(raw) * at)] ^= 0x40
    dst.write_bytes(bytes(raw))
    return dst


# top level ------------------------------------------------------------------------------------------


def test_no_command_prints_usage_and_exits_2(cli):
    res = cli()
    assert res.returncode == 2
    assert "verify" in res.stderr and "doctor" in res.stderr


def test_module_entry_point_version_usage_and_exit_codes(files, tmp_path):
    """``python -m lazyckpt`` in its own process: --version, usage (exit 2), a command's exit code."""
    res = cli_process("--version")
    assert res.returncode == 0 and res.stdout.startswith("lazyckpt ")
    res = cli_process()
    assert res.returncode == 2 and "verify" in res.stderr
    res = cli_process("verify", str(files / "lazy.pt"), str(tmp_path / "missing.pt"))
    assert res.returncode == 1 and res.stdout.splitlines()[0].startswith("OK"), res.stdout + res.stderr


def test_version(cli):
    res = cli("--version")
    assert res.returncode == 0 and res.stdout.startswith("lazyckpt ")


# verify ---------------------------------------------------------------------------------------------


def test_verify_good_files_one_line_each(files, cli):
    paths = [str(files / n) for n in ("lazy.pt", "stock.pt", "w.safetensors", "plain.ckpt")]
    res = cli("verify", *paths)
    assert res.returncode == 0, res.stdout + res.stderr
    lines = res.stdout.splitlines()
    assert [ln.split()[0] for ln in lines[:-1]] == ["OK"] * 4
    assert lines[-1] == "4 of 4 OK"


def test_verify_corrupt_missing_and_not_a_checkpoint_fail(files, tmp_path, cli):
    bad = _corrupt(files / "lazy.pt", tmp_path / "bad.pt")
    res = cli("verify", "--json", str(files / "stock.pt"), str(bad), str(tmp_path / "missing.pt"),
              str(files / "notes.txt"))  # fmt: skip
    assert res.returncode == 1
    doc = json.loads(res.stdout)
    assert (doc["ok"], doc["checked"], doc["failed"]) == (False, 4, 3)
    by_path = {Path(r["path"]).name: r for r in doc["results"]}
    assert by_path["stock.pt"]["ok"]
    assert any("CRC32" in p or "corrupt" in p for p in by_path["bad.pt"]["problems"])
    assert by_path["missing.pt"]["kind"] == "missing"
    assert not by_path["notes.txt"]["ok"]


def test_verify_directory_is_searched_recursively(files, tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "a.pt").write_bytes((files / "lazy.pt").read_bytes())
    (tmp_path / "b.safetensors").write_bytes((files / "w.safetensors").read_bytes())
    (tmp_path / "readme.md").write_text("ignored")
    assert main(["verify", str(tmp_path)]) == 0
    _corrupt(files / "stock.pt", tmp_path / "sub" / "c.pt", at=0.9)
    assert main(["verify", "-q", str(tmp_path)]) == 1


def test_verify_empty_directory_fails(tmp_path, capsys):
    assert main(["verify", str(tmp_path)]) == 1
    assert "no checkpoint files found" in capsys.readouterr().out


def _accelerate_folder(root: Path) -> Path:
    folder = root / "checkpoint_0"
    folder.mkdir()
    state = _state()
    save_file({k: v.clone() for k, v in state["model"].items()}, folder / "model.safetensors")
    torch.save(state["optim"], folder / "optimizer.bin")
    torch.save({"random_state": 1, "torch": torch.get_rng_state()}, folder / "random_states_0.pkl")
    return folder


def test_verify_accelerate_folder_complete_and_incomplete(tmp_path, cli):
    folder = _accelerate_folder(tmp_path)
    res = cli("verify", str(folder))
    assert res.returncode == 0, res.stdout
    assert "accelerate" in res.stdout.splitlines()[0]
    (folder / ".lazyckpt-pending-0-host-123-0").write_text("")
    res = cli("verify", str(tmp_path))
    assert res.returncode == 1
    assert "incomplete" in res.stdout


def test_verify_and_inspect_a_folder_checkpoint_of_any_kind(tmp_path, capsys):
    """The core's folder protocol (lazyckpt.commit.folder): any folder with a pending marker is incomplete."""
    from lazyckpt.commit.folder import FolderSave

    folder = tmp_path / "step_10"
    fs = FolderSave(folder, tag=0, submit=lambda job: job())
    torch.save({"w": torch.ones(3)}, folder / "shard_0.pt")
    assert main(["verify", str(folder)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "incomplete" in out and "still running" in out
    assert main(["inspect", str(folder)]) == 0
    assert "incomplete" in capsys.readouterr().err
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = folder / os.path.basename(fs.marker).replace(f"-{os.getpid()}-", f"-{int(dead.stdout)}-")
    os.rename(fs.marker, stale)
    assert main(["verify", str(folder)]) == 1
    assert "died: that save will never finish" in capsys.readouterr().out
    os.unlink(stale)
    assert main(["verify", str(folder)]) == 0
    assert main(["inspect", str(folder)]) == 0
    assert "incomplete" not in capsys.readouterr().err


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda f: (f / "random_states_0.pkl").unlink(), "random_states_0.pkl missing"),
        (lambda f: (f / "model.safetensors").unlink(), "no model file"),
        (lambda f: (f / "optimizer.bin").rename(f / "optimizer_1.bin"), "optimizer file(s) with index [0] missing"),
        (lambda f: (f / ".optimizer.bin.lazyckpt-1-0.tmp").write_bytes(b"x"), "unfinished write"),
    ],
)
def test_verify_accelerate_folder_missing_pieces(tmp_path, capsys, change, message):
    folder = _accelerate_folder(tmp_path)
    change(folder)
    assert main(["verify", str(folder)]) == 1
    assert message in capsys.readouterr().out


def test_verify_never_runs_code_from_the_file(files, cli):
    res = cli("verify", str(files / "evil.pt"))
    assert res.returncode == 0, res.stdout  # a well-formed file; its pickle is only walked
    assert not (files / "pwned").exists()


# inspect --------------------------------------------------------------------------------------------


def test_inspect_tree_totals_and_largest(files, cli):
    res = cli("inspect", str(files / "lazy.pt"))
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "model: OrderedDict, 3 entries" in out and "exp_avg_sq: float32 [50x8]" in out
    assert "totals: 9 tensors" in out and "share a storage" in out
    assert "largest" in out and "model/0.weight" in out


def test_inspect_json(files, cli):
    res = cli("inspect", "--json", str(files / "lazy.pt"))
    doc = json.loads(res.stdout)
    assert doc["format"] == "torch" and doc["loaded_with"] == "weights_only=True"
    assert doc["totals"]["tensors"] == 9 and doc["totals"]["tensors_sharing_storage"] == 1
    assert doc["totals"]["bytes"] == doc["totals"]["tensor_bytes"] - 50 * 8 * 4  # the tied weight counts once
    assert doc["largest"][0]["bytes"] == 50 * 8 * 4
    assert "lightning" not in doc


def test_inspect_lightning_metadata(files, cli):
    doc = json.loads(cli("inspect", "--json", str(files / "plain.ckpt")).stdout)
    meta = doc["lightning"]
    assert (meta["epoch"], meta["global_step"], meta["pytorch-lightning_version"]) == (3, 120, "2.6.6")
    assert meta["callbacks"] == ["ModelCheckpoint{'monitor': None}"] and meta["optimizer_states"] == 1


def test_inspect_refuses_pickled_objects_unless_unsafe(files, cli):
    res = cli("inspect", str(files / "hparams.ckpt"))
    assert res.returncode == 1
    assert "argparse.Namespace" in res.stderr and "--unsafe" in res.stderr
    res = cli("inspect", "--unsafe", str(files / "hparams.ckpt"))
    assert res.returncode == 0, res.stderr
    assert "global_step: 120" in res.stdout and "weights_only=False" in res.stdout


def test_inspect_never_runs_code_by_default(files, cli):
    res = cli("inspect", str(files / "evil.pt"))
    assert res.returncode == 1 and "--unsafe" in res.stderr
    assert not (files / "pwned").exists()


def test_inspect_safetensors_from_header(files, capsys):
    assert main(["inspect", "--json", str(files / "w.safetensors")]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["metadata"] == {"format": "pt"}
    assert {c["key"]: c["dtype"] for c in doc["tree"]["children"]} == {"w": "float32", "h": "bfloat16"}
    assert doc["totals"]["bytes"] == 4 * 3 * 4 + 5 * 2


def test_inspect_missing_and_not_a_checkpoint(files, tmp_path, cli):
    res = cli("inspect", str(tmp_path / "nope.pt"))
    assert res.returncode == 1 and "no such file" in res.stderr
    res = cli("inspect", str(files / "notes.txt"))
    assert res.returncode == 1 and "not a checkpoint" in res.stderr


def test_inspect_corrupt_file_says_run_verify(files, tmp_path, capsys):
    raw = (files / "stock.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(raw[: len(raw) // 2])
    assert main(["inspect", str(tmp_path / "cut.pt")]) == 1
    assert "lazyckpt verify" in capsys.readouterr().err


# doctor ---------------------------------------------------------------------------------------------

FAKE_NVML = {
    "absent": "raise ImportError('No module named pynvml')\n",
    "no_driver": (
        "class NVMLError(Exception):\n    pass\ndef nvmlInit():\n    raise NVMLError('NVML Shared Library Not Found')\n"
    ),
    "h100": (
        "from types import SimpleNamespace\n"
        "def nvmlInit(): pass\n"
        "def nvmlShutdown(): pass\n"
        "def nvmlSystemGetDriverVersion(): return b'580.00'\n"
        "def nvmlDeviceGetCount(): return 1\n"
        "def nvmlDeviceGetHandleByIndex(i): return i\n"
        "def nvmlDeviceGetName(h): return 'NVIDIA H100 80GB HBM3'\n"
        "def nvmlDeviceGetMemoryInfo(h): return SimpleNamespace(total=85899345920, free=85000000000, used=0)\n"
        "def nvmlDeviceGetCurrPcieLinkGeneration(h): return 1\n"
        "def nvmlDeviceGetCurrPcieLinkWidth(h): return 16\n"
        "def nvmlDeviceGetMaxPcieLinkGeneration(h): return 5\n"
        "def nvmlDeviceGetMaxPcieLinkWidth(h): return 16\n"
    ),
}


def _fake_nvml(tmp_path: Path, kind: str) -> Path:
    d = tmp_path / f"fake_{kind}"
    d.mkdir()
    (d / "pynvml.py").write_text(FAKE_NVML[kind])
    return d


def test_doctor_without_gpu_or_nvml(tmp_path, cli):
    res = cli("doctor", str(tmp_path), "--probe-mb", "4", "--ckpt-gb", "0.05", env={"CUDA_VISIBLE_DEVICES": ""},
              pythonpath=_fake_nvml(tmp_path, "absent"))  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "CUDA (torch):               not available" in out
    assert "nvidia-ml-py is not installed" in out and "pip install nvidia-ml-py" in out
    assert "no CUDA GPU visible to torch" in out
    assert "write + fsync:" in out and "GB/s (1 thread)" in out
    assert "LazyCheckpointer(host_memory_budget=" in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "the write probe left a file behind"


def test_doctor_nvml_without_driver(tmp_path, cli):
    res = cli("doctor", str(tmp_path), "--probe-mb", "4", "--json", env={"CUDA_VISIBLE_DEVICES": ""},
              pythonpath=_fake_nvml(tmp_path, "no_driver"))  # fmt: skip
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert not doc["gpus"]["nvml"]["ok"] and "NVML Shared Library Not Found" in doc["gpus"]["nvml"]["error"]
    assert doc["storage"]["gbps_1_thread"] > 0 and doc["host"]["memory_total"] > 0
    assert any("--ckpt-gb" in line for line in doc["advice"])


def test_doctor_reports_gpu_link_from_nvml(tmp_path, cli):
    res = cli("doctor", str(tmp_path), "--probe-mb", "4", "--ckpt-gb", "2", env={"CUDA_VISIBLE_DEVICES": ""},
              pythonpath=_fake_nvml(tmp_path, "h100"))  # fmt: skip
    assert res.returncode == 0, res.stderr
    out = res.stdout
    assert "NVIDIA H100 80GB HBM3" in out and "Gen1 x16 now, Gen5 x16 max" in out
    assert "63.0 GB/s link" in out and "~50 GB/s expected" in out
    assert "NVML sees GPUs but torch cannot use them" in out
    assert "idle GPUs train down" in out
    assert "GPU 0: copying the checkpoint to the host takes about 0.04 s" in out


def test_doctor_missing_dir_exits_1(tmp_path, cli):
    res = cli("doctor", str(tmp_path / "nope"))
    assert res.returncode == 1 and "not a directory" in res.stdout


def test_doctor_unwritable_dir_exits_1(tmp_path, monkeypatch, capsys):
    from lazyckpt.cli import _probe

    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_probe, "_timed_write", refuse)
    assert main(["doctor", str(tmp_path), "--probe-mb", "1"]) == 1
    assert "cannot write to" in capsys.readouterr().out


def test_doctor_in_process_without_nvml(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml -> ImportError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["doctor", str(tmp_path), "--probe-mb", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["gpus"]["cuda_available"] is False and "not installed" in doc["gpus"]["nvml"]["error"]


def _report(avail_gb: float, one: float, four: float, fs: str = "ext4 on /dev/sda (/)") -> dict:
    host = {"memory_available": int(avail_gb * 1e9), "memory_total": int(2 * avail_gb * 1e9), "memlock_soft": None,
            "cpus": 8}  # fmt: skip
    storage = {"filesystem": fs, "gbps_1_thread": one, "gbps_4_threads": four}
    return {"host": host, "storage": storage, "gpus": {"devices": [], "cuda_available": False}}


def test_recommendation_fits_a_whole_checkpoint_when_memory_allows():
    rec = doctor.recommend(1.0, _report(avail_gb=64, one=2.0, four=2.1))
    assert rec["host_memory_budget"] >= 1e9 and rec["writer_threads"] == 2  # parallel writes do not help
    assert "never wait" in rec["notes"][0]
    assert rec["seconds_to_durable"] == pytest.approx(1 / 2.1)


def test_recommendation_caps_the_budget_and_uses_more_writers_on_parallel_storage():
    rec = doctor.recommend(40.0, _report(avail_gb=16, one=1.0, four=3.0, fs="lustre on 10.0.0.1@tcp:/fs (/scratch)"))
    assert rec["host_memory_budget"] <= 8e9 and rec["writer_threads"] == 8
    assert "streams through" in rec["notes"][0]


# bench ----------------------------------------------------------------------------------------------


def test_bench_tiny_end_to_end(tmp_path, cli):
    out_json, png = tmp_path / "bench.json", tmp_path / "timeline.png"
    res = cli("bench", "--size", "tiny", "--steps", "2", "--rounds", "1", "--warmup", "0", "--out-dir",
              str(tmp_path / "ckpt"), "--json", str(out_json), "--plot", str(png), "--no-progress")  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    out = res.stdout
    for mode in ("none", "torch.save", "dcp", "write-only", "lazyckpt"):
        assert any(line.startswith(mode + " ") for line in out.splitlines()), out
    assert "vs torch.save" in out and "raw disk:" in out and "of raw disk" in out and "of engine cost" in out
    doc = json.loads(out_json.read_text())
    assert doc["modes"] == ["none", "torch.save", "dcp", "write-only", "lazyckpt"]
    for mode in doc["modes"]:
        steps = doc["timeline"][mode]["steps"]
        assert len(steps) == 2 and all(s["compute"] >= 0 and s["blocked"] >= 0 for s in steps)
    assert {w for _, _, w in doc["timeline"]["lazyckpt"]["background"]} == {"stage", "write"}
    assert set(doc["ratios"]["lazyckpt"]) <= {"torch.save", "dcp", "write-only"}
    assert doc["summary"]["raw_write_gbps"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_cuda_without_gpu_exits_1(cli):
    res = cli("bench", "--device", "cuda", env={"CUDA_VISIBLE_DEVICES": ""})
    assert res.returncode == 1 and "no CUDA GPU" in res.stderr and "lazyckpt doctor" in res.stderr


def test_bench_plot_without_matplotlib_exits_1_before_running(tmp_path, cli):
    fake = tmp_path / "fake"
    (fake / "matplotlib").mkdir(parents=True)
    (fake / "matplotlib" / "__init__.py").write_text("raise ImportError('No module named matplotlib')\n")
    res = cli("bench", "--plot", str(tmp_path / "x.png"), pythonpath=fake)
    assert res.returncode == 1 and "pip install matplotlib" in res.stderr
    assert not (tmp_path / "x.png").exists()


def test_bench_passes_arguments_and_exit_code_through(cli):
    res = cli("bench", "--modes", "torch.save,nope")
    assert res.returncode == 1 and "unknown mode" in res.stderr
    res = cli("bench", "--help")
    assert res.returncode == 0 and "benchmarks.bench_core" in res.stdout and "--size" in res.stdout
    res = cli("verify", "--size", "tiny")  # other commands still refuse arguments they do not know
    assert res.returncode == 2 and "unrecognized arguments" in res.stderr


def test_bench_without_a_checkout_says_how_to_get_it(monkeypatch, capsys):
    from lazyckpt.cli import bench

    monkeypatch.setattr(bench, "repository_root", lambda: None)
    assert main(["bench", "--size", "tiny"]) == 1
    err = capsys.readouterr().err
    assert "not part of the installed package" in err and "python -m benchmarks.bench_core" in err


def test_console_script_entry_point(tmp_path):
    """The installed `lazyckpt` script (pyproject [project.scripts]) runs the same CLI."""
    import shutil

    script = shutil.which("lazyckpt", path=os.path.dirname(sys.executable)) or shutil.which("lazyckpt")
    if script is None:
        pytest.skip("lazyckpt console script not installed (pip install -e .)")
    missing = tmp_path / "missing.pt"
    res = subprocess.run([script, "verify", str(missing)], capture_output=True, text=True)
    assert res.returncode == 1 and "missing.pt" in (res.stdout + res.stderr)
    assert subprocess.run([script, "--version"], capture_output=True, text=True).returncode == 0
