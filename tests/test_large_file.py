"""A real file over 4 GiB (zip64 sizes and offsets), read back by stock torch.load (issue 11, Also)."""

from __future__ import annotations

import gc

import pytest
import torch

from lazyckpt import LazyCheckpointer, verify

pytestmark = pytest.mark.slow(reason="past-4-GiB and 2-GiB files written, fsynced and read back")

_BIG = (4 << 30) + (64 << 20)  # past 4 GiB: the record's size and the next record's offset need zip64
_STEP = 256 << 20


def _pattern() -> torch.Tensor:
    return torch.arange(256, dtype=torch.int32).to(torch.uint8)


def _check(big: torch.Tensor) -> None:
    """Chunk by chunk: a whole-tensor comparison would allocate another 4 GiB."""
    want = _pattern().repeat(_STEP // 256)
    assert big.numel() == _BIG
    for start in range(0, _BIG, _STEP):
        part = big[start : start + _STEP]
        assert torch.equal(part, want[: part.numel()]), f"bytes differ in [{start}, {start + part.numel()})"


@pytest.mark.filterwarnings("ignore::lazyckpt.BackpressureWarning")  # 4 GiB through a 256 MiB budget: expected
def test_file_over_4_gib_loads_with_torch_load_and_mmap(tmp_path):
    path = tmp_path / "big.pt"  # tmp_path is on the disk, not /dev/shm
    big = _pattern().repeat(_BIG // 256)
    with LazyCheckpointer(host_memory_budget=256 << 20, chunk_bytes=64 << 20) as c:
        c.save({"big": big, "after": torch.arange(10), "step": 7}, path).wait()
    del big
    gc.collect()
    assert path.stat().st_size > _BIG
    assert verify(path).ok

    got = torch.load(path, mmap=True)
    assert got["step"] == 7 and torch.equal(got["after"], torch.arange(10))
    _check(got["big"])
    del got
    gc.collect()

    got = torch.load(path)
    assert torch.equal(got["after"], torch.arange(10))
    _check(got["big"])
    del got
    gc.collect()
