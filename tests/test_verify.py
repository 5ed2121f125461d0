"""verify() finds every flipped byte and every truncation, and passes clean files (ours and stock)."""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import save_file

from lazyckpt import LazyCheckpointer, VerificationError, verify


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("verify")
    obj = {
        "model": {"w": torch.randn(64, 64), "b": torch.zeros(64), "steps": torch.tensor(3)},
        "optim": {"state": {0: {"exp_avg": torch.randn(64, 64)}}, "param_groups": [{"lr": 0.1}]},
        "epoch": 2,
    }
    with LazyCheckpointer(chunk_bytes=4096) as c:
        c.save(obj, d / "lazy.pt").wait()
        c.save({"w": torch.randn(32, 32), "i": torch.arange(7)}, d / "lazy.safetensors", format="safetensors").wait()
    torch.save(obj, d / "stock.pt")
    save_file({"w": torch.randn(8)}, d / "stock.safetensors")
    return d


@pytest.mark.parametrize("name", ["lazy.pt", "stock.pt", "lazy.safetensors", "stock.safetensors"])
def test_clean_files_verify(files, name):
    report = verify(files / name)
    assert report.ok, report.problems
    assert report.records > 0
    report.raise_if_failed()


@pytest.mark.parametrize("name", ["lazy.pt", "stock.pt", "lazy.safetensors"])
def test_every_single_byte_corruption_is_detected(files, tmp_path, name):
    raw = (files / name).read_bytes()
    rng = random.Random(1234)
    # 100 random positions across the file plus every region boundary-ish byte at the start and end.
    positions = (
        [rng.randrange(len(raw)) for _ in range(100)] + list(range(0, 64)) + list(range(len(raw) - 120, len(raw)))
    )
    missed = []
    for i in positions:
        bad = bytearray(raw)
        bad[i] ^= 1 << rng.randrange(8)
        (tmp_path / "x").write_bytes(bytes(bad))
        if verify(tmp_path / "x").ok:
            missed.append(i)
    assert not missed, f"undetected corruption at byte(s) {missed[:10]} of {len(raw)}"


@pytest.mark.parametrize("name", ["lazy.pt", "lazy.safetensors"])
@pytest.mark.parametrize("cut", [1, 10, 100, 0.5])
def test_truncation_is_detected(files, tmp_path, name, cut):
    raw = (files / name).read_bytes()
    keep = int(len(raw) * cut) if isinstance(cut, float) else len(raw) - cut
    (tmp_path / "t").write_bytes(raw[:keep])
    report = verify(tmp_path / "t")
    assert not report.ok
    with pytest.raises(VerificationError):
        report.raise_if_failed()


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello, this is not a checkpoint at all")
    assert not verify(tmp_path / "notes.txt").ok
    (tmp_path / "empty").write_bytes(b"")
    assert not verify(tmp_path / "empty").ok
