"""lazyckpt.load(): parallel reads, CRCs checked while reading, what torch.load returns."""

from __future__ import annotations

import collections
import os

import pytest
import torch

import lazyckpt
from _util import assert_same
from lazyckpt import LazyCheckpointer, VerificationError


def _state() -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 8))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    return {
        "model": model.state_dict(),
        "opt": opt.state_dict(),
        "shared": [torch.arange(10)] * 2,  # one storage, two references
        "view": torch.arange(100.0)[10:20],
        "half": torch.randn(7).half(),
        "empty": torch.empty(0),
        "od": collections.OrderedDict(a=1, b="x"),
        "step": 3,
    }


def test_equals_torch_load_of_torch_save_files(tmp_path):
    state = _state()
    path = tmp_path / "stock.pt"
    torch.save(state, path)
    got = lazyckpt.load(path, piece_bytes=1 << 16, threads=4)  # many pieces: records span them
    assert_same(got, torch.load(path))
    assert_same(got, state)
    assert got["shared"][0].untyped_storage().data_ptr() == got["shared"][1].untyped_storage().data_ptr()


def test_equals_torch_load_of_lazyckpt_zero_copy_files(tmp_path):
    torch.manual_seed(1)
    big = torch.nn.Linear(1024, 1024)  # 4 MiB weights: written straight from memory, padded records
    opt = torch.optim.SGD(big.parameters(), lr=0.1)
    big(torch.randn(2, 1024)).sum().backward()
    opt.step()
    state = {"model": big.state_dict(), "opt": opt.state_dict()}
    path = tmp_path / "lazy.pt"
    with LazyCheckpointer(direct_io=True, zero_copy=True) as ck:
        ck.save(state, path).wait()
    assert_same(lazyckpt.load(path, piece_bytes=1 << 20), torch.load(path))


def test_crc_mismatch_raises_verification_error(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.randn(4096)}, path)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # inside the tensor's record
    path.write_bytes(bytes(data))
    with pytest.raises(VerificationError, match="CRC32"):
        lazyckpt.load(path)
    lazyckpt.load(path, verify=False)  # what torch.load would return: no check asked


def test_truncated_file_raises_verification_error(tmp_path):
    path = tmp_path / "x.pt"
    torch.save({"w": torch.randn(4096)}, path)
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)
    with pytest.raises(VerificationError):
        lazyckpt.load(path)


class Custom:
    def __init__(self) -> None:
        self.x = 1


def test_weights_only_default_refuses_arbitrary_pickles(tmp_path):
    path = tmp_path / "obj.pt"
    torch.save({"obj": Custom(), "w": torch.ones(3)}, path)
    with pytest.raises(Exception, match="[Ww]eights only"):
        lazyckpt.load(path)
    got = lazyckpt.load(path, weights_only=False)
    assert isinstance(got["obj"], Custom)


def test_map_location_cpu_and_found(tmp_path):
    path = tmp_path / "step-00000004.pt"
    torch.save({"w": torch.ones(3)}, path)
    found = lazyckpt.Found(str(path), 4, 0)
    assert_same(lazyckpt.load(found, map_location="cpu"), {"w": torch.ones(3)})


def test_legacy_format_goes_to_torch_load(tmp_path):
    path = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(3)}, path, _use_new_zipfile_serialization=False)
    assert_same(lazyckpt.load(path), {"w": torch.ones(3)})


@pytest.mark.gpu
def test_map_location_cuda_through_pinned_buffers(tmp_path):
    state = _state()
    path = tmp_path / "x.pt"
    torch.save(state, path)
    got = lazyckpt.load(path, map_location="cuda")
    assert got["model"]["0.weight"].is_cuda
    assert_same(got, torch.load(path, map_location="cuda"))
