"""Files written lazily read back with stock loaders exactly as torch.save's / safetensors' do."""

from __future__ import annotations

import collections
import io
import zipfile

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _util import assert_same
from lazyckpt import LazyCheckpointer
from lazyckpt.formats import torch_zip as _torchfmt

ODD_DTYPES = [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8, torch.int16,
    torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
]  # fmt: skip


def odd_tensors() -> dict:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    return {
        "view": base[1:3, 2:5],  # a view: torch.save stores the whole storage
        "base": base,  # shares storage with "view"
        "transposed": base.t(),  # non-contiguous
        "strided": torch.arange(50.0)[::7],
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 3),
        "nan": torch.tensor([float("nan"), -0.0, float("inf")]),
        "grad": torch.ones(3, requires_grad=True),
        "param": torch.nn.Parameter(torch.randn(2, 2)),
        "dtypes": {str(dt): (torch.arange(6) % 2).to(dt) for dt in ODD_DTYPES},
        "nested": [1, "two", (torch.ones(2), {"deep": [torch.zeros(1, dtype=torch.int64)]})],
        "ordered": collections.OrderedDict(b=torch.ones(1), a=2.5),
        "none": None,
        "bytes": b"\x00\x01",
    }


def lazy_save(ckpt: LazyCheckpointer, obj, path, **kw):
    return ckpt.save(obj, path, **kw).wait()


def test_torch_load_reads_odd_tensors_like_torch_save(ckpt, tmp_path):
    obj = odd_tensors()
    lazy_save(ckpt, obj, tmp_path / "lazy.pt")
    torch.save(obj, tmp_path / "stock.pt")
    for kwargs in ({}, {"mmap": True}, {"weights_only": False}):
        got = torch.load(tmp_path / "lazy.pt", **kwargs)
        want = torch.load(tmp_path / "stock.pt", **kwargs)
        assert_same(got, want)
        assert_same(got, obj)


def test_shared_storage_stays_shared(ckpt, tmp_path):
    obj = odd_tensors()
    lazy_save(ckpt, obj, tmp_path / "lazy.pt")
    got = torch.load(tmp_path / "lazy.pt")
    assert got["view"].untyped_storage().data_ptr() == got["base"].untyped_storage().data_ptr()
    got["base"][1, 2] = -1.0
    assert got["view"][0, 0] == -1.0


def test_zip_is_valid_and_matches_torch_save_layout(ckpt, tmp_path):
    obj = odd_tensors()
    lazy_save(ckpt, obj, tmp_path / "a.pt")
    torch.save(obj, tmp_path / "b.pt")  # same-length name: same layout
    with zipfile.ZipFile(tmp_path / "a.pt") as za, zipfile.ZipFile(tmp_path / "b.pt") as zb:
        assert za.testzip() is None
        la = [(i.filename.split("/", 1)[1], i.header_offset, i.file_size) for i in za.infolist()]
        lb = [(i.filename.split("/", 1)[1], i.header_offset, i.file_size) for i in zb.infolist()]
        assert la == lb
        for name in za.namelist():
            if "serialization_id" not in name:
                assert za.read(name) == zb.read(name.replace("a/", "b/", 1)), name
    assert (tmp_path / "a.pt").stat().st_size == (tmp_path / "b.pt").stat().st_size


def test_torch_load_from_file_object_and_bytes(ckpt, tmp_path):
    lazy_save(ckpt, {"w": torch.randn(5)}, tmp_path / "x.pt")
    data = (tmp_path / "x.pt").read_bytes()
    assert torch.load(io.BytesIO(data))["w"].shape == (5,)


@pytest.mark.parametrize("limit", [1, 200, 5000])
def test_zip64_records_read_back(ckpt, tmp_path, monkeypatch, limit):
    """Force zip64 fields at small sizes/offsets: the same code path a >4 GiB checkpoint takes."""
    monkeypatch.setattr(_torchfmt, "_ZIP64_LIMIT", limit)
    obj = {"a": torch.randn(1000), "b": torch.arange(3000, dtype=torch.int16), "c": torch.ones(2)}
    lazy_save(ckpt, obj, tmp_path / "z.pt")
    assert zipfile.ZipFile(tmp_path / "z.pt").testzip() is None
    assert_same(torch.load(tmp_path / "z.pt"), obj)
    assert_same(torch.load(tmp_path / "z.pt", mmap=True), obj)


def test_multi_piece_records_get_correct_crc(tmp_path):
    """A storage larger than a chunk is written in pieces by several threads; CRCs combine."""
    obj = {"big": torch.randn(300_000), "small": torch.ones(10)}
    with LazyCheckpointer(host_memory_budget=1 << 20, chunk_bytes=64 << 10, writer_threads=3) as c:
        c.save(obj, tmp_path / "p.pt").wait()
    assert zipfile.ZipFile(tmp_path / "p.pt").testzip() is None
    assert_same(torch.load(tmp_path / "p.pt"), obj)


def test_safetensors_round_trip(ckpt, tmp_path):
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    tensors = {
        "w": torch.randn(3, 4),
        "b16": torch.randn(5).to(torch.bfloat16),
        "i8": torch.arange(7, dtype=torch.int8),
        "mask": torch.tensor([True, False]),
        "scalar": torch.tensor(2.0),
        "empty": torch.empty(0),
        "offset_view": torch.arange(10.0)[4:8],
    }
    ckpt.save(tensors, tmp_path / "m.safetensors", format="safetensors", metadata={"format": "pt"}).wait()
    assert_same(_sorted(load_file(tmp_path / "m.safetensors")), _sorted(tensors))
    with safe_open(tmp_path / "m.safetensors", "pt") as f:
        assert f.metadata()["format"] == "pt"
    save_file({k: v.contiguous() for k, v in tensors.items()}, tmp_path / "stock.safetensors")
    assert_same(_sorted(load_file(tmp_path / "stock.safetensors")), _sorted(load_file(tmp_path / "m.safetensors")))


def _sorted(d: dict) -> dict:
    return dict(sorted(d.items()))


tensor_strategy = st.builds(
    lambda dtype, shape, seed, transpose: _make_tensor(dtype, shape, seed, transpose),
    st.sampled_from(ODD_DTYPES),
    st.lists(st.integers(0, 5), min_size=0, max_size=3),
    st.integers(0, 2**16),
    st.booleans(),
)


def _make_tensor(dtype, shape, seed, transpose):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        t = torch.rand(shape, generator=g) > 0.5
    else:
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
    return t.t() if transpose and t.dim() == 2 else t


nested_strategy = st.recursive(
    st.one_of(tensor_strategy, st.integers(), st.text(max_size=5), st.none(), st.floats(allow_nan=False)),
    lambda children: st.one_of(
        st.lists(children, max_size=4),
        st.dictionaries(st.text(min_size=1, max_size=4), children, max_size=4),
        st.tuples(children, children),
    ),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(obj=nested_strategy)
def test_hypothesis_round_trip_matches_torch_save(ckpt, tmp_path, obj):
    h = ckpt.save(obj, tmp_path / "h.pt")
    torch.save(obj, tmp_path / "s.pt")
    h.wait()
    assert zipfile.ZipFile(tmp_path / "h.pt").testzip() is None
    assert_same(torch.load(tmp_path / "h.pt", weights_only=False), torch.load(tmp_path / "s.pt", weights_only=False))
    assert_same(torch.load(tmp_path / "h.pt", mmap=True), obj)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tensors=st.dictionaries(st.text(min_size=1, max_size=6), tensor_strategy, max_size=6))
def test_hypothesis_safetensors_round_trip(ckpt, tmp_path, tensors):
    from safetensors.torch import load_file

    tensors = {k: v.contiguous().clone() for k, v in tensors.items()}
    tensors = {k: v for k, v in tensors.items() if v.dtype != torch.complex128}
    ckpt.save(tensors, tmp_path / "h.safetensors", format="safetensors").wait()
    assert_same(_sorted(load_file(tmp_path / "h.safetensors")), _sorted(tensors))


@pytest.mark.parametrize("fmt", ["torch", "safetensors"])
@pytest.mark.parametrize("direct_io", [True, False])
def test_direct_io_files_read_back(tmp_path, monkeypatch, direct_io, fmt):
    """O_DIRECT for whole pages, buffered partial pages and headers: the same file either way."""
    from safetensors.torch import load_file

    from lazyckpt import verify
    from lazyckpt.core import pool as _pool
    from lazyckpt.storage import fs as _fs

    used = []
    real = _fs.pwrite_all
    monkeypatch.setattr(
        _fs, "pwrite_all", lambda fd, data, off: (used.append((fd, len(data), off)), real(fd, data, off))
    )
    obj = {
        "big": torch.randn(300_001),
        "odd": torch.randn(1234),
        "tiny": torch.ones(1),
        "half": torch.randn(70_001, dtype=torch.float16),
        "view": torch.arange(9000.0)[5:],
    }
    if fmt == "safetensors":
        obj = {k: v.clone() for k, v in obj.items()}
    path = tmp_path / ("d.pt" if fmt == "torch" else "d.safetensors")
    with LazyCheckpointer(chunk_bytes=256 << 10, direct_io=direct_io) as c:
        c.save(obj, path, format=fmt).wait()
    if fmt == "torch":
        assert_same(torch.load(path), obj)
        assert_same(torch.load(path, mmap=True), obj)
        assert zipfile.ZipFile(path).testzip() is None
        with zipfile.ZipFile(path) as z:
            assert z.read("d/.storage_alignment") == b"64"  # torch.save's default layout either way
    else:
        assert_same(_sorted(load_file(path)), _sorted(obj))
    assert verify(path).ok
    assert len({fd for fd, _, _ in used}) == (2 if direct_io else 1), "whole pages go through the O_DIRECT descriptor"
    if direct_io:
        dfd = {fd for fd, _, _ in used} - {used[-1][0]}  # the last write is a header: buffered descriptor
        for fd, n, off in used:  # O_DIRECT writes are page-aligned; no page gets both kinds of write
            if fd in dfd:
                assert off % _pool.PAGE == 0 and n % _pool.PAGE == 0
        direct_pages = {p for fd, n, off in used if fd in dfd for p in range(off // 4096, (off + n) // 4096)}
        buffered_pages = {
            p for fd, n, off in used if fd not in dfd for p in range(off // 4096, (off + n - 1) // 4096 + 1)
        }
        assert direct_pages and not direct_pages & buffered_pages


def test_direct_io_is_chosen_by_where_the_bytes_are_not_by_the_average_size():
    """Most bytes in tensors of >= 1 MiB: direct I/O, even when many small tensors pull the average
    below 1 MiB (FSDP2 shards of a ~100M GPT on 2 ranks: 1.03 MB on average, and buffered writes
    cost them ~4x the CPU). Small checkpoints, or ones made mostly of small tensors: buffered."""
    from lazyckpt.core.plan import use_direct_io

    with LazyCheckpointer() as c:
        mib = 1 << 20
        assert use_direct_io(c.options.direct_io, [2 * mib] * 300 + [4096] * 300)  # average ~1.0 MB
        assert not use_direct_io(c.options.direct_io, [512 << 10] * 100)  # 50 MiB, all in small tensors
        assert not use_direct_io(c.options.direct_io, [4 * mib, 4 * mib])  # 8 MiB in all
        assert not use_direct_io(c.options.direct_io, [20 * mib] + [512 << 10] * 50)  # less than half in large tensors
        assert use_direct_io(c.options.direct_io, [20 * mib] + [512 << 10] * 30)
