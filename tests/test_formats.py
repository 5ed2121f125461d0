"""The format planners: each one's bytes are exactly the stock writer's, and reserved fields stay ours."""

from __future__ import annotations

import io
import zipfile
import zlib

import pytest
import safetensors.torch
import torch
from safetensors.torch import load_file

from _util import assert_same
from lazyckpt import LazyCheckpointer, SaveRefusedError, verify
from lazyckpt.formats import base as _format
from lazyckpt.formats import torch_zip as _torchfmt


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize("value", ["abc", "12345678", "00000000"])
def test_reserved_safetensors_metadata_key_is_refused(tmp_path, crc, value):
    """Issue 11 item 1: a user's ``lazyckpt_crc32`` (e.g. metadata copied from an earlier lazyckpt
    file) used to land where the CRC is patched in: the file did not parse (short value) or did not
    verify (any other value). It is refused before anything is written."""
    path = tmp_path / "m.safetensors"
    with LazyCheckpointer(crc=crc) as c, pytest.raises(SaveRefusedError, match="lazyckpt_crc32"):
        c.save({"w": torch.arange(4.0)}, path, format="safetensors", metadata={"lazyckpt_crc32": value, "a": "b"})
    assert not path.exists()
    assert list(tmp_path.iterdir()) == []


def test_metadata_copied_from_a_lazyckpt_file_saves_once_the_reserved_key_is_dropped(tmp_path):
    from safetensors import safe_open

    with LazyCheckpointer() as c:
        c.save({"w": torch.arange(4.0)}, tmp_path / "a.safetensors", format="safetensors", metadata={"k": "v"}).wait()
        with safe_open(tmp_path / "a.safetensors", "pt") as f:
            meta = f.metadata()
        assert "lazyckpt_crc32" in meta
        meta.pop("lazyckpt_crc32")
        c.save({"w": torch.ones(3)}, tmp_path / "b.safetensors", format="safetensors", metadata=meta).wait()
    assert torch.equal(load_file(tmp_path / "b.safetensors")["w"], torch.ones(3))
    assert verify(tmp_path / "b.safetensors").ok


# Byte for byte: each planner against the stock writer ----------------------------------------------


def _planned_file(format: str, obj, path, metadata=None, crc: bool = True) -> bytes:
    """Write a file the way the engine does, from the format's plan alone: every data region from
    its source, then the layout's fixed and CRC-dependent writes."""
    planner = _format.get(format).flatten(obj, metadata)
    layout = planner.plan(str(path), {}, crc=crc)
    out = bytearray(b"\xee" * layout.file_bytes)  # any byte the layout forgets shows up
    crcs = {}
    for src in planner.sources:
        data = src.flat.numpy().tobytes()
        assert len(data) == src.nbytes
        out[src.file_offset : src.file_offset + src.nbytes] = data
        crcs[src.key] = zlib.crc32(data)
    for offset, data in [*layout.fixed_writes(), *layout.crc_writes(crcs if crc else None)]:
        out[offset : offset + len(data)] = data
    return bytes(out)


def _stock_torch(obj, path, monkeypatch) -> bytes:
    """torch.save's bytes; our planner is made to draw the same random serialization id."""
    torch.save(obj, path)
    with zipfile.ZipFile(path) as z:
        sid = z.read(f"{_torchfmt.archive_name(str(path))}/.data/serialization_id").decode()
    monkeypatch.setattr(_torchfmt, "_serialization_id", lambda: sid)
    return path.read_bytes()


def _torch_objects() -> dict[str, object]:
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return {
        "views_and_shared": {"view": base[1:3, 2:5], "base": base, "t": base.t(), "strided": torch.arange(50.0)[::7]},
        "offset_views_of_one_storage": [base[2], base[0], base.view(-1)[5:7]],
        "empty_and_0d": {"empty": torch.empty(0, 3), "scalar": torch.tensor(3.5), "none": None, "e2": torch.zeros(0)},
        "dtypes": {
            str(dt): (torch.arange(6) % 2).to(dt)
            for dt in (torch.bfloat16, torch.bool, torch.complex64, torch.complex128, torch.float16, torch.int8)
        },
        "non_ascii": {"größe": torch.ones(2), "重み": torch.zeros(3, dtype=torch.int64), "🙂": 1},
        "optimizer": {"model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": 3},
        "no_tensors": {"a": 1, "b": [2.5, "x"]},
        "parameter": torch.nn.Parameter(torch.randn(2, 2)),
        "big": {"w": torch.randn(300_000), "i": torch.arange(70_000, dtype=torch.int16)},
        # What the fast pickling path reduces itself (metadata bits, requires_grad, an empty state dict
        # with its _metadata attribute), all in one object.
        "fast_path": {
            "plain": torch.ones(3),
            "conj": torch.ones(2, dtype=torch.complex64).conj(),  # metadata (conj bit) in the record
            "neg": torch.ones(2, dtype=torch.complex64).conj().imag,  # the neg bit
            "grad": torch.ones(2, requires_grad=True),
            "empty_module": torch.nn.Sequential(torch.nn.ReLU()).state_dict(),  # empty, with its _metadata
            "after": torch.arange(3.0),
        },
        # What it leaves to torch, which makes the whole object go the plain path: a tensor with Python
        # state (torch's _rebuild_from_type_v2 carries its storage), untyped storages in the pickle (a
        # storage saved by itself; torch's v3 record of a uint16 tensor).
        "tensor_with_attribute": {"a": torch.ones(2), "attribute": _with_attribute(torch.zeros(2))},
        "storage_by_itself": [torch.ones(2), torch.arange(5, dtype=torch.int32).untyped_storage(), torch.zeros(1)],
        "v3_dtype_record": {"a": torch.ones(2), "uint16": torch.tensor([1, 2, 65535], dtype=torch.uint16)},
    }


def _with_attribute(t: torch.Tensor) -> torch.Tensor:
    t.note = "kept"
    return t


TORCH_CASES = list(_torch_objects())


@pytest.mark.parametrize("case", TORCH_CASES)
@pytest.mark.parametrize("name", ["ckpt.pt", "model-ä.pth", "noext"])
def test_torch_planner_writes_torch_save_bytes(tmp_path, monkeypatch, case, name):
    obj = _torch_objects()[case]
    (tmp_path / "stock").mkdir()
    want = _stock_torch(obj, tmp_path / "stock" / name, monkeypatch)
    assert _planned_file("torch", obj, tmp_path / name) == want


@pytest.mark.parametrize("case", ["optimizer", "fast_path"])
def test_plain_tensors_are_pickled_without_tensor_reduce_ex_and_the_bytes_stay_torch_saves(tmp_path, monkeypatch, case):
    """The fast pickling path (``capture._Pickler``) reduces plain tensors itself: torch's
    ``Tensor._reduce_ex_internal`` is never called for a model + optimizer state (or the fast path's
    own cases), and the bytes are still torch.save's (made before the patch)."""
    from lazyckpt.formats import capture

    obj = _torch_objects()[case]
    (tmp_path / "stock").mkdir()
    want = _stock_torch(obj, tmp_path / "stock" / "o.pt", monkeypatch)
    assert capture._fast_path_works()

    def refuse(*args, **kwargs):
        raise AssertionError("Tensor._reduce_ex_internal called: the fast path was not taken")

    monkeypatch.setattr(torch.Tensor, "_reduce_ex_internal", refuse)
    assert _planned_file("torch", obj, tmp_path / "o.pt") == want


class _Held:  # a tensor tensor_names cannot name: it is an attribute of an object
    def __init__(self, t):
        self.t = t


def test_pickling_builds_a_tensor_description_only_for_tensors_without_a_name():
    """reducer_override runs for every tensor on save()'s thread: the fallback text for a tensor that
    tensor_names could not name is built only for such a tensor, not as a default for every lookup."""
    from lazyckpt.formats import capture

    class Names(dict):
        defaults: list[object] = []

        def get(self, key, *default):
            self.defaults.extend(default)
            return super().get(key, *default)

    obj = _torch_objects()["optimizer"]
    names = Names(capture.tensor_names(obj))
    for fast in (True, False):
        capture._pickle(obj, names, fast)
    assert names.defaults == []
    with pytest.raises(SaveRefusedError, match=r"<tensor inside an object, shape \(3,\)>: meta tensors"):
        capture.flatten_torch({"held": _Held(torch.empty(3, device="meta"))})


@pytest.mark.parametrize(
    "case",
    ["fast_path", "tensor_with_attribute", "storage_by_itself", "v3_dtype_record", "optimizer", "views_and_shared"],
)
def test_the_plain_pickling_path_writes_the_same_bytes(tmp_path, monkeypatch, case):
    """Where the interpreter does not let the fast path work (its self-check fails), the plain path is
    torch.save's own pickling: same bytes."""
    from lazyckpt.formats import capture

    obj = _torch_objects()[case]
    (tmp_path / "stock").mkdir()
    want = _stock_torch(obj, tmp_path / "stock" / "p.pt", monkeypatch)
    monkeypatch.setattr(capture, "_PERSISTENT_ID", None)
    monkeypatch.setattr(capture, "_FAST", [])
    assert _planned_file("torch", obj, tmp_path / "p.pt") == want
    assert capture._FAST == [False]


@pytest.mark.parametrize("alignment", [128, 4096])
def test_torch_planner_follows_a_configured_storage_alignment(tmp_path, monkeypatch, alignment):
    config = pytest.importorskip("torch.utils.serialization").config
    obj = _torch_objects()["views_and_shared"]
    (tmp_path / "stock").mkdir()
    with config.patch({"save.storage_alignment": alignment}):
        want = _stock_torch(obj, tmp_path / "stock" / "a.pt", monkeypatch)
        assert _planned_file("torch", obj, tmp_path / "a.pt") == want


@pytest.mark.parametrize("name", ["c.pt", "ä.pt"])
@pytest.mark.parametrize("case", ["views_and_shared", "dtypes", "optimizer", "empty_and_0d", "big"])
def test_torch_files_through_the_checkpointer_are_torch_save_bytes(tmp_path, monkeypatch, case, name):
    """The whole path (stage, write in pieces, combine CRCs, Job.metadata_writes) with zero_copy=False."""
    obj = _torch_objects()[case]
    (tmp_path / "stock").mkdir()
    want = _stock_torch(obj, tmp_path / "stock" / name, monkeypatch)
    with LazyCheckpointer(zero_copy=False, chunk_bytes=64 << 10, host_memory_budget=1 << 20) as c:
        c.save(obj, tmp_path / name).wait()
    assert (tmp_path / name).read_bytes() == want


def test_torch_planner_without_crc_writes_zero_storage_crcs(tmp_path, monkeypatch):
    """crc=False: storage records carry CRC 0, as torch.save's skip_data files do; the rest is unchanged."""
    obj = {"w": torch.randn(10), "b": torch.ones(3)}
    (tmp_path / "stock").mkdir()
    want = _stock_torch(obj, tmp_path / "stock" / "n.pt", monkeypatch)
    got = _planned_file("torch", obj, tmp_path / "n.pt", crc=False)
    assert len(got) == len(want)
    with zipfile.ZipFile(io.BytesIO(got)) as zg, zipfile.ZipFile(io.BytesIO(want)) as zw:
        for g, w in zip(zg.infolist(), zw.infolist(), strict=True):
            assert (g.filename, g.header_offset, g.file_size) == (w.filename, w.header_offset, w.file_size)
            assert (0 if "/data/" in g.filename else w.CRC) == g.CRC


@pytest.mark.parametrize("limit", [1, 300, 5000])
def test_torch_planner_zip64_layout_verifies(tmp_path, monkeypatch, limit):
    """torch.save switches to zip64 only past 4 GiB, so lowered thresholds cannot be compared with
    it: the file must still read back, pass zipfile's CRC test and lazyckpt's own verify."""
    monkeypatch.setattr(_torchfmt, "_ZIP64_LIMIT", limit)
    obj = _torch_objects()["big"]
    path = tmp_path / "z.pt"
    path.write_bytes(_planned_file("torch", obj, path))
    assert zipfile.ZipFile(path).testzip() is None
    assert verify(path).ok, verify(path).problems
    assert_same(torch.load(path), obj)


def _safetensors_objects() -> dict[str, dict[str, torch.Tensor]]:
    return {
        "dtypes": {
            "bf16": torch.arange(5).to(torch.bfloat16),
            "bool": torch.tensor([True, False, True]),
            "c64": torch.arange(3).to(torch.complex64),
            "f64": torch.arange(2.0, dtype=torch.float64),
            "i8": torch.arange(7, dtype=torch.int8),
            "f16": torch.arange(3).half(),
            "u8": torch.arange(9).byte(),
        },  # fmt: skip
        "empty_and_0d": {"e": torch.empty(0, 4), "s": torch.tensor(2.5), "z": torch.zeros(0, dtype=torch.int64)},
        "non_ascii": {"größe": torch.ones(2), "重み": torch.zeros(3), 'a"b\\c': torch.ones(1)},
        "views_of_disjoint_parts": {"a": torch.arange(10.0)[:4], "b": torch.arange(10.0)[6:]},
        "ordering": {f"k{i}": torch.ones(i + 1, dtype=dt) for i, dt in enumerate([torch.int8, torch.float32] * 4)},
        "single": {"w": torch.randn(1000)},
    }


@pytest.mark.parametrize("case", list(_safetensors_objects()))
# One key at most: safetensors keeps metadata in a hash map, so the order of several keys is random.
@pytest.mark.parametrize("metadata", [None, {"format": "pt"}, {"ключ": "значение"}, {'quote"\n': "\\\t"}])
def test_safetensors_planner_writes_safetensors_bytes(tmp_path, case, metadata):
    tensors = _safetensors_objects()[case]
    want = safetensors.torch.save(tensors, metadata=metadata)
    assert _planned_file("safetensors", tensors, tmp_path / "a.safetensors", metadata, crc=False) == want


@pytest.mark.parametrize("case", list(_safetensors_objects()))
def test_safetensors_planner_with_crc_loads_and_verifies(tmp_path, case):
    tensors = _safetensors_objects()[case]
    path = tmp_path / "a.safetensors"
    path.write_bytes(_planned_file("safetensors", tensors, path, {"format": "pt"}))
    assert_same(dict(sorted(load_file(path).items())), dict(sorted(tensors.items())))
    assert verify(path).ok, verify(path).problems


def test_safetensors_files_through_the_checkpointer_are_safetensors_bytes(tmp_path):
    tensors = {**_safetensors_objects()["dtypes"], "big": torch.randn(100_000)}
    with LazyCheckpointer(crc=False, zero_copy=False, chunk_bytes=64 << 10, host_memory_budget=1 << 20) as c:
        c.save(tensors, tmp_path / "a.safetensors", format="safetensors", metadata={"m": "1"}).wait()
    assert (tmp_path / "a.safetensors").read_bytes() == safetensors.torch.save(tensors, metadata={"m": "1"})


def test_unknown_format_is_refused(tmp_path):
    with LazyCheckpointer() as c, pytest.raises(SaveRefusedError, match="unknown format 'npz'"):
        c.save({"w": torch.ones(1)}, tmp_path / "x", format="npz")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("crc", [True, False])
@pytest.mark.parametrize("format", ["torch", "safetensors"])
@pytest.mark.parametrize("with_phases", [False, True])
def test_layout_writes_every_byte_exactly_once(tmp_path, format, crc, with_phases):
    """The contract a writer relies on (``_format.Layout``): data regions, fixed writes and
    CRC-dependent writes tile the file, with no gap and no overlap, zero-copy padding included."""
    tensors = {
        "a": torch.randn(3000),
        "b": torch.arange(777, dtype=torch.int16),
        "c": torch.ones(0),
        "d": torch.ones(5),
    }
    planner = _format.get(format).flatten(tensors, None)
    phases = {s.key: (64 * (i + 1) * 7) % 4096 for i, s in enumerate(planner.sources)} if with_phases else {}
    layout = planner.plan(str(tmp_path / "x"), phases, crc=crc)
    if with_phases:  # the planner honoured at least one (safetensors: one data start for all)
        assert any(s.file_offset % 4096 == phases[s.key] for s in planner.sources if s.nbytes)
    crcs = {s.key: 1 for s in planner.sources} if crc else None
    spans = [(s.file_offset, s.file_offset + s.nbytes) for s in planner.sources]
    spans += [(o, o + len(d)) for o, d in [*layout.fixed_writes(), *layout.crc_writes(crcs)]]
    spans = sorted(span for span in spans if span[0] != span[1])
    assert spans[0][0] == 0 and spans[-1][1] == layout.file_bytes
    for (_, end), (start, _) in zip(spans, spans[1:], strict=False):
        assert start == end, (end, start)


def test_torch_planner_zip64_metadata_matches_torch_save_past_4gib(tmp_path, monkeypatch):
    """Real zip64, not a lowered threshold: a 4 GiB + 20 byte storage (sizes past 4 GiB) followed by
    records at offsets past 4 GiB. The tensor is never touched (no memory) and torch.save writes it
    under ``skip_data`` (a sparse file, zero storage CRCs): every byte the layout writes besides
    data must equal torch.save's, and the file sizes must match."""
    try:
        big = torch.empty((1 << 30) + 5, dtype=torch.float32)  # virtual memory only: never written
    except RuntimeError as exc:  # no overcommit on this host
        pytest.skip(f"cannot reserve 4 GiB of address space: {exc}")
    obj = {"small": torch.ones(10), "w": big, "after": torch.arange(3.0)}
    (tmp_path / "stock").mkdir()
    stock = tmp_path / "stock" / "big.pt"
    with torch.serialization.skip_data():
        torch.save(obj, stock)
    if stock.stat().st_blocks * 512 > 1 << 30:
        stock.unlink()
        pytest.skip("this filesystem does not keep files sparse")
    with zipfile.ZipFile(stock) as z:
        sid = z.read("big/.data/serialization_id").decode()
        assert any(i.file_size >= 1 << 32 for i in z.infolist()) and z.infolist()[-1].header_offset >= 1 << 32
    monkeypatch.setattr(_torchfmt, "_serialization_id", lambda: sid)
    planner = _format.get("torch").flatten(obj, None)
    layout = planner.plan(str(tmp_path / "big.pt"), {}, crc=False)
    assert layout.file_bytes == stock.stat().st_size
    with open(stock, "rb") as fh:
        for offset, data in [*layout.fixed_writes(), *layout.crc_writes(None)]:
            fh.seek(offset)
            assert fh.read(len(data)) == data, offset
    stock.unlink()


def test_verify_accepts_either_compressed_size_in_a_local_zip64_field(tmp_path, monkeypatch):
    """torch.save states 0 there (and so does lazyckpt now); earlier lazyckpt files state the size.
    Both are intact; any other value is damage."""
    monkeypatch.setattr(_torchfmt, "_ZIP64_LIMIT", 300)
    obj = {"w": torch.randn(1000)}
    path = tmp_path / "z.pt"
    raw = bytearray(_planned_file("torch", obj, path))
    with zipfile.ZipFile(io.BytesIO(bytes(raw))) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data/0"))
    at = info.header_offset + 30 + len(info.orig_filename) + 4 + 8  # zip64 field: size, then compressed size
    assert raw[at : at + 8] == bytes(8)
    for value, ok in [(info.file_size, True), (info.file_size + 1, False), (1 << 40, False)]:
        bad = bytearray(raw)
        bad[at : at + 8] = value.to_bytes(8, "little")
        path.write_bytes(bytes(bad))
        assert verify(path).ok is ok, (value, verify(path).problems)


@pytest.mark.parametrize("nbytes", [0, 1, (1 << 20) - 1, 1 << 20, (5 << 20) + 12345])
def test_crc_computed_slice_by_slice_beside_the_write_is_the_whole_crc(tmp_path, nbytes):
    """The writers' buffered path CRCs each 1 MiB slice just before writing it (the copy then reads
    it from cache): the CRC it returns is the whole data's, and every byte lands at its offset."""
    import os

    from lazyckpt.core.engine import write_buffered

    data = os.urandom(nbytes)
    path = tmp_path / "f.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        assert write_buffered(fd, memoryview(data), 7, crc=True) == zlib.crc32(data)
        assert write_buffered(fd, memoryview(data), 7, crc=False) == 0
    finally:
        os.close(fd)
    assert path.read_bytes() == (b"\0" * 7 + data if nbytes else b"")
