"""Checking and reading checkpoints: CRC verification of files, folders and URLs (``verify``, ``check``,
``dcp``), parallel reads with CRCs (``reads``), and a torch.save file read ahead with its check
(``preread``, ``Preread``: what ``latest()`` hands to ``load()``); ``load()`` of a file or a ``Found``."""

from . import _read as reads
from ._found import Found
from ._load import load
from ._preread import (
    FileSource,
    Preread,
    Seekable,
    ZipEntry,
    check_compressed,
    check_crc,
    check_small,
    data_records,
    is_zip,
    preread,
    read_storages,
    records,
)
from ._read import READ_THREADS, FileIdentity

__all__ = [
    "Found",
    "load",
    "READ_THREADS",
    "FileIdentity",
    "FileSource",
    "Preread",
    "Seekable",
    "ZipEntry",
    "check_compressed",
    "check_crc",
    "check_small",
    "data_records",
    "is_zip",
    "preread",
    "read_storages",
    "reads",
    "records",
]
