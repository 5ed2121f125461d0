"""lazyckpt.load(): parallel reads, CRCs checked while reading, what torch.load returns."""

from __future__ import annotations

import collections
import copy
import os
import pickle
import shutil

import pytest
import torch

import lazyckpt
from _util import assert_same
from lazyckpt import IncompleteCheckpointWarning, LazyCheckpointer, VerificationError


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


@pytest.mark.parametrize("mmap", [None, True, False])
def test_mmap_is_honoured_not_passed_twice(tmp_path, mmap):
    state = _state()
    path = tmp_path / "stock.pt"
    torch.save(state, path)
    got = lazyckpt.load(path, mmap=mmap)  # once a TypeError: torch.load got mmap twice
    assert_same(got, state)
    weight = got["model"]["0.weight"]
    os.remove(path)  # mapped or not, the tensors stay readable
    assert_same(weight, state["model"]["0.weight"])


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


# -- one CRC pass per resume: latest() verifies, load() trusts only that very, unchanged file -------------


def _flip_middle_byte(path) -> None:
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0xFF]))


@pytest.fixture
def crc_passes(monkeypatch):
    """How many CRC passes (``read_with_crcs`` calls that check at least one range, and load()'s
    reads of the storages into memory with their CRCs checked) ran."""
    from lazyckpt.recovery import _preread, _read
    from lazyckpt.recovery import verify as _verify

    count = [0]
    real = _read.read_with_crcs
    real_storages = _preread.read_storages

    def counted(read_into, size, ranges, **kwargs):
        count[0] += bool(ranges)
        return real(read_into, size, ranges, **kwargs)

    def counted_storages(source, data, threads, piece, crc):
        count[0] += bool(crc)
        return real_storages(source, data, threads, piece, crc)

    monkeypatch.setattr(_read, "read_with_crcs", counted)  # load(mmap=True)'s
    monkeypatch.setattr(_verify, "read_with_crcs", counted)  # verify()'s
    monkeypatch.setattr(_preread, "read_storages", counted_storages)  # latest()'s and load()'s
    return count


def _level_with_one_step(tmp_path, value: float = 1.0):
    folder = tmp_path / "level"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "step-00000007.pt"
    torch.save({"w": torch.full((4096,), value)}, path)
    os.utime(path, ns=(1_000_000_000, 1_000_000_000))  # written long ago, as a resumed checkpoint is
    return folder, path


def test_a_resume_checks_every_crc_once(tmp_path, crc_passes):
    folder, _ = _level_with_one_step(tmp_path)
    found = lazyckpt.latest([folder])
    assert found.verified is not None and crc_passes[0] == 1
    assert_same(lazyckpt.load(found), {"w": torch.full((4096,), 1.0)})
    assert crc_passes[0] == 1  # load() trusted latest()'s pass over the same, unchanged file
    lazyckpt.load(found.path)
    assert crc_passes[0] == 2  # a path says nothing about what was checked: checked again


def test_an_agreed_latest_also_reads_the_file_once(tmp_path, crc_passes):
    """latest() collective (agreed through the store) checks this rank's copy with the same one pass
    and hands its storages to load(), as the local latest() does."""
    import torch.distributed as dist

    from lazyckpt.cluster import StoreExchange
    from lazyckpt.resume import latest_agreed

    folder, path = _level_with_one_step(tmp_path)
    exchange = StoreExchange(dist.HashStore(), "t", rank=0, world=1, timeout=5)
    found = latest_agreed([folder], exchange, preload=True)
    assert found.path == str(path) and found.verified is not None and found.preread is not None
    assert crc_passes[0] == 1
    assert_same(lazyckpt.load(found), {"w": torch.full((4096,), 1.0)})
    assert crc_passes[0] == 1  # load() took latest()'s storages: no second pass
    assert str(found) == os.fspath(found) == found.path


def test_an_agreed_latest_checks_a_folder_that_is_no_dcp_checkpoint_whole(tmp_path):
    """An Accelerate-style ``step-<n>`` folder (no lazyckpt DCP manifest) is a candidate of a collective
    latest() as of a local one: checked whole, not refused for lacking a DCP manifest."""
    import torch.distributed as dist

    from lazyckpt.cluster import StoreExchange
    from lazyckpt.resume import latest_agreed

    folder = tmp_path / "level" / "step-00000003"
    folder.mkdir(parents=True)
    torch.save({"w": torch.ones(8)}, folder / "model.bin")
    torch.save({"step": 3}, folder / "random_states_0.pkl")  # what Accelerate's every process writes
    exchange = StoreExchange(dist.HashStore(), "t", rank=0, world=1, timeout=5)
    found = latest_agreed([tmp_path / "level"], exchange)
    assert found is not None and found.path == str(folder) and found.step == 3


def test_a_resume_reads_the_file_once(tmp_path, monkeypatch):
    """latest() reads the storages while checking them; load(found) unpickles those, once; the
    next load of the same Found reads the file again, into memory of its own."""
    from lazyckpt.recovery import _preread

    folder, _ = _level_with_one_step(tmp_path)
    reads = []
    real = _preread.read_storages
    monkeypatch.setattr(_preread, "read_storages", lambda *a, crc: reads.append(crc) or real(*a, crc=crc))
    found = lazyckpt.latest([folder])
    assert found.preread is not None and found.preread.nbytes == 4096 * 4 and reads == [True]
    first = lazyckpt.load(found)
    assert reads == [True] and found.preread.nbytes == 0  # taken: the Found holds nothing more
    assert_same(first, {"w": torch.full((4096,), 1.0)})
    second = lazyckpt.load(found)
    assert reads == [True, False]  # read again; not checked again (same identity)
    first["w"].add_(1)
    assert_same(second, {"w": torch.full((4096,), 1.0)})  # memory of its own
    found = lazyckpt.latest([folder])
    sent = pickle.loads(pickle.dumps(found))  # broadcast to the other ranks: the name, not the memory
    assert sent == found and sent.preread is None and found.preread.nbytes == 4096 * 4
    assert copy.deepcopy(found).preread is None
    assert lazyckpt.latest([folder], preload=False).preread is None
    assert lazyckpt.latest([folder], verify=False).preread is None


def test_a_path_load_takes_what_latest_read_ahead_while_its_found_lives(tmp_path, monkeypatch):
    from lazyckpt.recovery import _preread

    folder, path = _level_with_one_step(tmp_path)
    reads = []
    real = _preread.read_storages
    monkeypatch.setattr(_preread, "read_storages", lambda *a, crc: reads.append(crc) or real(*a, crc=crc))
    found = lazyckpt.latest([folder])
    assert_same(lazyckpt.load(str(path)), {"w": torch.full((4096,), 1.0)})
    assert reads == [True] and found.preread.nbytes == 0  # the path's load took them
    found = lazyckpt.latest([folder])
    lazyckpt.recovery.Preread.release(str(path))  # a loader reading the path itself frees them
    assert found.preread.nbytes == 0
    assert_same(lazyckpt.load(found), {"w": torch.full((4096,), 1.0)})
    assert reads == [True, True, False]


def test_a_corrupt_newest_file_holds_nothing_and_the_older_one_is_preread(tmp_path):
    folder, _ = _level_with_one_step(tmp_path, 1.0)
    newer = folder / "step-00000009.pt"
    torch.save({"w": torch.full((4096,), 2.0)}, newer)
    _flip_middle_byte(newer)
    with pytest.warns(IncompleteCheckpointWarning, match="step-00000009"):
        found = lazyckpt.latest([folder])
    assert found.step == 7 and found.preread is not None
    assert_same(lazyckpt.load(found), {"w": torch.full((4096,), 1.0)})


def test_an_unverified_found_is_checked_by_load(tmp_path, crc_passes):
    folder, path = _level_with_one_step(tmp_path)
    _flip_middle_byte(path)
    unchecked = lazyckpt.latest([folder], verify=False)
    assert unchecked.verified is None
    with pytest.raises(VerificationError, match="CRC32"):
        lazyckpt.load(unchecked)
    with pytest.raises(VerificationError, match="CRC32"):  # made by hand: nothing was verified
        lazyckpt.load(lazyckpt.Found(str(path), 7, 0))


def test_a_file_changed_in_place_after_latest_is_checked_again(tmp_path):
    folder, path = _level_with_one_step(tmp_path)
    found = lazyckpt.latest([folder])
    _flip_middle_byte(path)  # same inode and size; a new mtime
    with pytest.raises(VerificationError, match="CRC32"):
        lazyckpt.load(found)


def test_a_file_renamed_over_the_name_after_latest_is_checked_again(tmp_path):
    folder, path = _level_with_one_step(tmp_path)
    found = lazyckpt.latest([folder])
    other = tmp_path / "other.pt"
    shutil.copyfile(path, other)
    _flip_middle_byte(other)
    shutil.copystat(path, other)  # even with the same size and times: another inode
    os.replace(other, path)
    with pytest.raises(VerificationError, match="CRC32"):
        lazyckpt.load(found)


@pytest.mark.parametrize("mmap", [None, True])
def test_load_maps_the_file_it_checked_not_what_was_renamed_onto_its_name(tmp_path, monkeypatch, mmap):
    """The window between load()'s CRC pass and torch.load's open: a new file renamed onto the
    name there must not be what is returned (it was never checked)."""
    from lazyckpt.recovery import _load, _preread

    _, path = _level_with_one_step(tmp_path, 1.0)
    _, replacement = _level_with_one_step(tmp_path / "b", 2.0)
    module, name = (_preread, "read_storages") if mmap is None else (_load, "_read_checked")
    real = getattr(module, name)

    def then_replace(*args, **kwargs):
        out = real(*args, **kwargs)
        os.replace(replacement, path)
        return out

    monkeypatch.setattr(module, name, then_replace)
    assert_same(lazyckpt.load(path, mmap=mmap), {"w": torch.full((4096,), 1.0)})
    assert_same(torch.load(path), {"w": torch.full((4096,), 2.0)})


def test_verify_names_the_file_it_read_only_when_it_passed(tmp_path):
    _, path = _level_with_one_step(tmp_path)
    report = lazyckpt.verify(path, threads=1)
    assert report.ok and report.identity is not None and report.identity.size == os.path.getsize(path)
    _flip_middle_byte(path)
    report = lazyckpt.verify(path)
    assert not report.ok and report.identity is None


@pytest.mark.parametrize("threads", [1, 3])
def test_read_with_crcs_gives_each_ranges_crc_whatever_the_pieces(threads):
    """Ranges across pieces and chunks, touching, overlapping, empty, at the ends; into a buffer or not."""
    import random
    import zlib

    from lazyckpt.recovery._read import read_with_crcs

    rng = random.Random(threads)
    data = os.urandom(100_003)
    ranges = [(0, 10), (10, 100_003), (5, 5), (99_990, 100_003), (1_000, 50_000), (30_000, 30_001)]
    ranges += [tuple(sorted(rng.randrange(len(data) + 1) for _ in range(2))) for _ in range(20)]

    def read_into(view, offset):
        view[:] = data[offset : offset + len(view)]

    for piece, chunk in ((1 << 20, 1 << 20), (4096, 1000), (777, 100)):
        into = memoryview(bytearray(len(data)))
        for target in (None, into):
            got = read_with_crcs(read_into, len(data), ranges, threads=threads, piece=piece, chunk=chunk, into=target)
            assert got == [zlib.crc32(data[a:b]) for a, b in ranges], (piece, chunk)
        assert bytes(into) == data


def _mapped(path) -> bool:
    real = os.path.realpath(path)
    with open("/proc/self/maps") as fh:
        return any(line.rstrip().endswith(real) for line in fh)


@pytest.mark.parametrize("mmap", [None, False, True])
def test_load_reads_storages_into_memory_of_their_own_unless_mmap(tmp_path, mmap):
    """A resume's first optimizer step must not pay copy-on-write page copies of a mapped file: by
    default every storage is read into memory the process owns (as torch.load does), in one pass
    with the CRC check; views keep sharing their storage. ``mmap=True`` maps the file as before."""
    import gc

    base = torch.arange(1 << 16, dtype=torch.float32)
    state = {"a": base, "view": base[10:20], "b": torch.ones(3, dtype=torch.int64), "empty": torch.empty(0)}
    folder, path = tmp_path / "lvl", None
    with LazyCheckpointer(levels=[lazyckpt.Level(folder, every=1, keep=1)]) as ckpt:
        ckpt.save(state, step=1).wait()
    found = lazyckpt.latest([folder])
    path = found.path
    got = lazyckpt.load(found, mmap=mmap)
    assert_same(got, state)
    assert got["view"].untyped_storage().data_ptr() == got["a"].untyped_storage().data_ptr()
    assert _mapped(path) is bool(mmap)
    got["a"].add_(1)  # the tensors are the caller's: writable, the file untouched
    assert_same(torch.load(path), state)
    del got
    gc.collect()
    assert not _mapped(path)


def test_load_without_torchs_storage_hook_falls_back_to_torch_load(tmp_path, monkeypatch):
    """A torch whose private ``_load`` has no ``overall_storage`` (or options the private call cannot
    take): the checked descriptor is read by torch.load itself, same result, still checked."""
    import torch.serialization as ser

    state = {"w": torch.arange(1 << 12, dtype=torch.float64), "step": 3}
    path = tmp_path / "a.pt"
    torch.save(state, path)
    real = ser._load
    monkeypatch.setattr(ser, "_load", lambda zip_file, map_location, pickle_module, **kw: real(
        zip_file, map_location, pickle_module, **kw))  # fmt: skip
    assert_same(lazyckpt.load(path), state)
    monkeypatch.setattr(ser, "_load", real)
    assert_same(lazyckpt.load(path, weights_only=False, pickle_module=__import__("pickle")), state)
    _flip_middle_byte(path)
    with pytest.raises(VerificationError, match="CRC32"):
        lazyckpt.load(path)
    reads = []
    real_read = lazyckpt.recovery._preread.read_storages
    monkeypatch.setattr(lazyckpt.recovery._preread, "read_storages", lambda *a: reads.append(a) or real_read(*a))
    monkeypatch.setattr(ser, "_load", lambda zip_file, map_location, pickle_module, **kw: real(
        zip_file, map_location, pickle_module, **kw))  # fmt: skip
    with pytest.raises(VerificationError, match="CRC32"):  # the fallback checks too, reading the file once
        lazyckpt.load(path)
    assert not reads
