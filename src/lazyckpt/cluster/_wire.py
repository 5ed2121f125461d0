"""The wire of replication: one gloo round sends one rank's files to a peer while receiving
another's (``Link``); the receiver renames each file only once its CRC32 matches the primary's
(``Sink``, index last), or a folder only once it checks whole (``FolderSink``)."""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from lazyckpt.formats.crc import crc32
from lazyckpt.storage import fs as _fs
from lazyckpt.storage import spare as _spare

CHUNK = 32 << 20
OK, FAILED, CRC_MISMATCH = 0, -1, -2  # acknowledgments; > 0: an errno
LATER = -1  # ``open_files``: the CRC32 is read later (``crc_of``, on the sending thread)


@dataclass
class OutFile:
    """One file to send: open now (a later unlink of its name does not change what is sent)."""

    name: str
    fd: int
    size: int
    crc: int

    def close(self) -> None:
        try:
            os.close(self.fd)
        except OSError:
            pass


def open_files(folder: str, files: Sequence[tuple[str, int | None]], lock: bool = False) -> list[OutFile]:
    """``folder``'s ``files`` (name, CRC32 | ``LATER`` | None: computed now) opened for sending;
    ``lock``: share-locked (``storage/spare.py``)."""
    out: list[OutFile] = []
    try:
        for name, want in files:
            path = os.path.join(folder, name)
            out.append(OutFile(name, os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)), 0, LATER))
            fd = out[-1].fd
            if lock:
                _spare.share_lock(fd, path)
            size = out[-1].size = os.fstat(fd).st_size
            out[-1].crc = crc_of(fd, size) if want is None else int(want)
    except BaseException:
        for f in out:
            f.close()
        raise
    return out


def folder_files(folder: str) -> list[tuple[str, int | None]]:
    """A complete flat folder checkpoint's visible files for ``open_files`` (CRC32s ``LATER``);
    ``OSError`` for a subfolder."""
    out: list[tuple[str, int | None]] = []
    for name in sorted(os.listdir(folder)):
        if name.startswith("."):
            continue
        if os.path.isdir(os.path.join(folder, name)):
            raise OSError(errno.EISDIR, f"{folder}/{name}: a folder inside a checkpoint folder is not replicated")
        out.append((name, LATER))
    return out


def crc_of(fd: int, size: int) -> int:
    crc, offset = 0, 0
    while offset < size:
        data = os.pread(fd, min(CHUNK, size - offset), offset)
        if not data:
            raise OSError(errno.EIO, f"file ended at byte {offset} of {size}")
        crc, offset = crc32(data, crc), offset + len(data)
    return crc


class Sink:
    """The receiving end of one part: files under temporary names in ``folder``, each CRC-checked
    against the primary's CRC32 from the header before its rename; the index last (``commit``).
    Every byte is drained even after a failure, so the link stays in step."""

    def __init__(
        self, folder: str, header: dict[str, Any], fsync: bool, index_name: str | None,
        check: Callable[[str], None] | None = None,
    ) -> None:  # fmt: skip
        self.folder, self.header, self.fsync, self.index_name = folder, header, fsync, index_name
        self.check = check  # each whole file before its rename; OSError counts as a CRC mismatch
        self.error: BaseException | None = None
        self.crc_mismatch = False
        self._fd: int | None = None
        self._crc = 0
        self._tmp = ""
        self._done: list[str] = []

    def begin(self, name: str, size: int) -> None:
        if self.error is not None:
            return
        try:
            os.makedirs(self.folder, exist_ok=True)
            self._tmp = os.path.join(self.folder, f".{name}.lazyckpt-replica.tmp")
            _fs.discard(self._tmp)
            self._fd, self._crc = _fs.open_temporary(self._tmp, size), 0
        except BaseException as exc:  # noqa: BLE001 - acknowledged to the sender
            self.error = exc

    def write(self, data: memoryview, offset: int) -> None:
        if self.error is not None or self._fd is None:
            return
        try:
            _fs.pwrite_all(self._fd, data, offset)
            self._crc = crc32(data, self._crc)
        except BaseException as exc:  # noqa: BLE001
            self.error = exc

    def end(self, name: str, want: int) -> None:
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self.error is None and self._crc != want:
                self.crc_mismatch = True
                raise OSError(errno.EIO, f"{name}: CRC32 {self._crc:#010x} received, the primary's is {want:#010x}")
            if self.error is None and self.check is not None:
                try:
                    self.check(self._tmp)
                except OSError as exc:
                    self.crc_mismatch = True
                    raise OSError(errno.EIO, f"{name}: {exc}") from exc
            if self.error is None and self.fsync:
                _fs.fsync(fd)
        except BaseException as exc:  # noqa: BLE001
            self.error = exc
        finally:
            os.close(fd)
        if self.error is None:
            try:
                os.replace(self._tmp, os.path.join(self.folder, name))
                self._done.append(name)
                return
            except OSError as exc:
                self.error = exc
        _fs.discard(self._tmp)

    def abandon(self) -> None:
        """The round failed mid-file (the sender died): no temporary file is left behind."""
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)
            _fs.discard(self._tmp)

    def commit(self) -> int:
        """The acknowledgment: the index written (``index_name``) when every file came whole."""
        if self.error is None and self.index_name is not None:
            try:
                index = {"files": self.header["files"], "from": self.header.get("from")}
                path = os.path.join(self.folder, self.index_name)
                tmp = path + ".tmp"
                with open(tmp, "w") as f:
                    json.dump(index, f)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException as exc:  # noqa: BLE001
                self.error = exc
        if self.error is None:
            return OK
        for name in self._done:  # no half part left under final names without its index
            _fs.discard(os.path.join(self.folder, name))
        return self._status()

    def _status(self) -> int:
        if self.crc_mismatch:
            return CRC_MISMATCH
        code = getattr(self.error, "errno", None)
        return code if isinstance(code, int) and code > 0 else FAILED


class FolderSink(Sink):
    """A folder checkpoint received into a staging folder beside ``final``; at ``commit`` it is
    checked whole (``check_folder`` raises ``OSError``) and renamed to ``final``. Never a partial
    folder at ``final``; a failure removes the staging folder."""

    def __init__(self, final: str, header: dict[str, Any], fsync: bool, check_folder: Callable[[str], None]) -> None:
        super().__init__(_fs.temporary_path(final), header, fsync, None)
        self.final = final
        self.check_folder = check_folder

    def commit(self) -> int:
        if self.error is None:
            try:
                os.makedirs(self.folder, exist_ok=True)
                try:
                    self.check_folder(self.folder)
                except OSError:
                    self.crc_mismatch = True
                    raise
                _fs.publish_folder(self.folder, self.final, self.fsync)
            except BaseException as exc:  # noqa: BLE001 - acknowledged to the sender
                self.error = exc
        if self.error is None:
            return OK
        shutil.rmtree(self.folder, ignore_errors=True)
        return self._status()

    def abandon(self) -> None:
        super().abandon()
        shutil.rmtree(self.folder, ignore_errors=True)


class Link:
    """One round on a gloo group: send ``files`` to ``dst`` while receiving ``src``'s part into a
    ``Sink`` (either side may be None): sizes, a JSON header, the chunks, then the acknowledgment.
    ``run`` returns (the peer's ack, the sink) and raises on a transport failure."""

    def __init__(self, group: Any) -> None:
        self.group = group

    def run(
        self,
        dst: int | None,
        header: dict[str, Any] | None,
        files: Sequence[OutFile],
        src: int | None,
        sink_for: Callable[[dict[str, Any]], Sink] | None,
    ) -> tuple[int | None, Sink | None]:
        import torch
        import torch.distributed as dist

        def exchange(out: torch.Tensor | None, into: torch.Tensor | None) -> None:
            works = []
            if out is not None and dst is not None:
                works.append(dist.isend(out, group=self.group, group_dst=dst))
            if into is not None and src is not None:
                works.append(dist.irecv(into, group=self.group, group_src=src))
            for w in works:
                if w is not None:
                    w.wait()

        blob = json.dumps(header or {}).encode()
        theirs = torch.zeros(1, dtype=torch.int64)
        exchange(torch.tensor([len(blob)], dtype=torch.int64), theirs)
        incoming = torch.empty(int(theirs.item()) if src is not None else 0, dtype=torch.uint8)
        exchange(torch.frombuffer(bytearray(blob), dtype=torch.uint8) if dst is not None else None, incoming)
        sink = None
        recv_plan: list[tuple[str, int, int, int]] = []  # (name, size, offset, length) per chunk
        head: dict[str, Any] = {}
        if src is not None:
            head = json.loads(bytes(incoming.numpy()).decode())
            recv_plan = _chunks([(f["name"], int(f["size"])) for f in head.get("files", [])])
            if sink_for is not None:
                sink = sink_for(head)
        send_plan = _chunks([(f.name, f.size) for f in files]) if dst is not None else []
        by_name = {f.name: f for f in files}
        out_buf, in_buf = torch.empty(CHUNK, dtype=torch.uint8), torch.empty(CHUNK, dtype=torch.uint8)
        out_view, in_view = memoryview(out_buf.numpy()), memoryview(in_buf.numpy())  # type: ignore[arg-type]
        crcs = {f["name"]: int(f["crc32"]) for f in head.get("files", [])}
        for i in range(max(len(send_plan), len(recv_plan))):
            out = into = None
            if i < len(send_plan):
                name, _, offset, length = send_plan[i]
                got = os.preadv(by_name[name].fd, [out_view[:length]], offset)
                if got != length:
                    raise OSError(errno.EIO, f"{name} ended at byte {offset + got} while sending it")
                out = out_buf[:length]
            if i < len(recv_plan):
                into = in_buf[: recv_plan[i][3]]
                if sink is not None and recv_plan[i][2] == 0:
                    sink.begin(recv_plan[i][0], recv_plan[i][1])
            exchange(out, into)
            if i < len(recv_plan) and sink is not None:
                name, size, offset, length = recv_plan[i]
                sink.write(in_view[:length], offset)
                if offset + length == size:
                    sink.end(name, crcs[name])
        if sink is not None:  # zero-byte files have no chunk
            for entry in head.get("files", []):
                if int(entry["size"]) == 0:
                    sink.begin(entry["name"], 0)
                    sink.end(entry["name"], crcs[entry["name"]])
        status = sink.commit() if sink is not None else OK
        ack = torch.zeros(1, dtype=torch.int64)
        works = []
        if src is not None:
            works.append(dist.isend(torch.tensor([status], dtype=torch.int64), group=self.group, group_dst=src))
        if dst is not None:
            works.append(dist.irecv(ack, group=self.group, group_src=dst))
        for w in works:
            if w is not None:
                w.wait()
        return (int(ack.item()) if dst is not None else None), sink


def _chunks(files: Sequence[tuple[str, int]]) -> list[tuple[str, int, int, int]]:
    return [(name, size, off, min(CHUNK, size - off)) for name, size in files for off in range(0, size, CHUNK)]


def header_of(files: Sequence[OutFile], **extra: Any) -> dict[str, Any]:
    return {"files": [{"name": f.name, "size": f.size, "crc32": f.crc} for f in files], **extra}
