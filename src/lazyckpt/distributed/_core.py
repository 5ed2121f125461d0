"""The one place the distributed package touches the core's internals.

A rank's data file is one core ``Job``: its sources are the tensors this rank writes, its
``layout`` a ``RankFileLayout`` (the same duck type as ``_torchfmt.TorchLayout``:
``data_offset(key)``, ``metadata_writes(crcs)``, ``total_size``), and it runs on a
``LazyCheckpointer``'s engine: same pool, same guard (the next ``optimizer.step()`` waits for this
rank's lazy copies only), same writers, same commit of the file inside the staging directory.
If the core's job interface changes, only this module follows.
"""

from __future__ import annotations

import functools
import time

import torch

from .. import _commit, _guard
from .._flatten import Source, flatten_torch
from .._handle import SaveHandle
from .._job import Job
from ..checkpointer import LazyCheckpointer
from ._layout import RankFileLayout


def tensor_pickle(t: torch.Tensor) -> bytes:
    """The pickle torch.save writes for a contiguous CPU tensor of ``t``'s dtype and shape whose
    storage (key "0") holds exactly its bytes: what DCP's writer saves for every tensor item (it
    clones views of larger storages). It depends on dtype and shape only: cached, since every save
    of a training run has the same items."""
    return _pickle_for(t.dtype, tuple(t.shape))


@functools.lru_cache(maxsize=8192)
def _pickle_for(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    # torch.empty reserves address space and touches none of it.
    pickle_bytes, sources = flatten_torch(torch.empty(shape, dtype=dtype))
    assert [s.key for s in sources] in ([], ["0"])
    return pickle_bytes


def guarded_storages() -> set[int]:
    """``_guard.guarded_storages`` that also sees through DTensors (FSDP2, tensor parallel): the
    optimizer holds DTensors, whose own storage is not accessible; their local shards' is."""
    ptrs: set[int] = set()
    with _guard._lock:
        optimizers = list(_guard._tracked)
    for opt in optimizers:
        tensors = [p for group in opt.param_groups for p in group["params"]]
        tensors += [v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
        for t in tensors:
            ptrs.add(_local(t).untyped_storage().data_ptr())
    ptrs.discard(0)
    return ptrs


def _local(t: torch.Tensor) -> torch.Tensor:
    local = getattr(t, "_local_tensor", None)  # DTensor
    return local if isinstance(local, torch.Tensor) else t


def start_file(
    ckpt: LazyCheckpointer,
    path: str,
    tensors: list[tuple[str, str, torch.Tensor]],
    layout: RankFileLayout,
    t0: float,
) -> SaveHandle:
    """Start writing ``path`` (atomically, through a temporary name beside it) on ``ckpt``'s engine.

    ``tensors``: (layout key, name for errors, contiguous tensor). Tensors an optimizer owns are
    copied lazily (the guard holds its next step back until they are); the rest here, now.
    """
    guarded = guarded_storages()
    sources: list[Source] = []
    for key, name, t in tensors:
        nbytes = t.numel() * t.element_size()
        flat = t.reshape(-1).view(torch.uint8) if nbytes else torch.empty(0, dtype=torch.uint8)
        sources.append(Source(key, flat, nbytes, [(name, t, t._version)], file_offset=layout.data_offset(key)))
    lazy = [s for s in sources if s.nbytes and s.storage_ptr in guarded]
    eager = [s for s in sources if s.nbytes and s.storage_ptr not in guarded]
    direct = ckpt._use_direct_io([s.nbytes for s in sources])
    job = Job(
        path=path, tmp=_commit.temporary_path(path), fmt="torch", sources=sources, lazy=lazy,
        layout=layout,  # type: ignore[arg-type]  # the same duck type as TorchLayout
        head=b"", file_bytes=layout.total_size, crc=ckpt.crc, fsync=ckpt.fsync,
        wait_in_closure=ckpt.wait_in_closure, t0=t0,
    )  # fmt: skip
    ckpt._start(job, eager, direct)
    job.t_returned = time.perf_counter()
    return job.handle
