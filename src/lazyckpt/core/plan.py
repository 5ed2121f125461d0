"""Save planning for one file (``LazyCheckpointer``'s and the distributed rank files): which sources are
copied lazily or in ``save()``, which go through ``O_DIRECT`` or are written from their own memory (zero
copy), and whether ``save()`` writes the file itself. ``SavePlan.decide`` runs before the format lays
out the file (giving the page phases it must honour), ``SavePlan.split`` after.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from lazyckpt.core import guard as _guard
from lazyckpt.formats.capture import Source
from lazyckpt.options import CheckpointerOptions
from lazyckpt.storage import fs as _fs
from lazyckpt.storage.fs import PAGE

ZERO_COPY_MIN = 1 << 20  # below this, a tensor's two partial pages would be most of it
INLINE_MAX_BYTES = 64 << 20  # a disk file's tensor bytes written in save() when every core trains
TINY_MAX_BYTES = 1 << 20  # a CPU file's tensor bytes written in save() with a core to spare too


@dataclass
class SavePlan:
    """How one file's sources are staged and written (see the module docstring)."""

    direct: bool = False  # whole pages through an O_DIRECT descriptor
    zero_copy: bool = False  # large optimizer-owned CPU tensors written from their own memory
    inline: bool = False  # save() writes the whole file itself (memory filesystem, no spare core)
    guarded: set[int] = field(default_factory=set)  # storages an optimizer's step (the guard) protects
    phases: dict[str, int] = field(default_factory=dict)  # source key -> data address within its page

    @classmethod
    def decide(
        cls,
        options: CheckpointerOptions,
        sources: list[Source],
        final: str,
        *,
        allow_inline: bool = True,
        capture_in_save: bool | None = None,
    ) -> SavePlan:
        """Before the layout. ``final``: the file's final path (its filesystem decides ``inline``).
        ``capture_in_save``: the option's value unless given (rank files of a distributed save are
        always planned lazily)."""
        devices = [s.device for s in sources]
        memory = bool(final) and _fs.is_memory_filesystem(os.path.dirname(os.path.abspath(final)))
        inline = allow_inline and _inline(options, memory, devices, sum(s.nbytes for s in sources))
        capture = options.capture_in_save if capture_in_save is None else capture_in_save
        # All eager: skip listing the guarded storages (it walks every tracked optimizer's tensors).
        eager_only = capture or inline or not any(s.nbytes for s in sources)
        guarded = set() if eager_only else _guard.guarded_storages()
        direct = not inline and use_direct_io(options.direct_io, [s.nbytes for s in sources])
        # Zero copy where a write needs no staging: O_DIRECT, or a memory filesystem (a write is a copy).
        zero_copy = (direct or (memory and not inline)) and options.zero_copy and all(d.type != "cuda" for d in devices)
        # Ask the format to place what will be written straight from memory where its pages line up.
        phases = {s.key: s.data_ptr % PAGE for s in sources if zero_copy and zero_copy_candidate(s, guarded)}
        return cls(direct=direct, zero_copy=zero_copy, inline=inline, guarded=guarded, phases=phases)

    def split(self, sources: list[Source]) -> tuple[list[Source], list[Source]]:
        """After the layout (every ``file_offset`` set): mark live sources (data and file offset at the same
        position within a page); return (lazy, eager). Empty storages are neither."""
        lazy: list[Source] = []
        eager: list[Source] = []
        for src in sources:
            if src.nbytes:
                (lazy if src.storage_ptr in self.guarded else eager).append(src)
            src.live = (
                self.zero_copy and zero_copy_candidate(src, self.guarded)
                and (src.data_ptr - src.file_offset) % PAGE == 0
            )  # fmt: skip
        return lazy, eager


def use_direct_io(option: bool | None, sizes: list[int]) -> bool:
    """``option`` (the ``direct_io`` option) if set; else direct I/O for at least 16 MiB with most bytes in
    tensors of 1 MiB or more (smaller pieces are written buffered anyway)."""
    if option is not None:
        return option
    nbytes = sum(sizes)
    large = sum(n for n in sizes if n >= 1 << 20)
    return nbytes >= 16 << 20 and 2 * large >= nbytes


def write_in_save(memory: bool, devices: list[torch.device], nbytes: int = 0) -> bool:
    """Whether ``save()`` writes the file itself on the caller's thread (only fsync and commit in the
    background). Never for device tensors; always for at most ``TINY_MAX_BYTES`` of tensor data; and,
    when training uses every core (``torch.get_num_threads()`` >= usable CPUs), for a memory filesystem
    or a disk file of at most ``INLINE_MAX_BYTES``."""
    if any(d.type != "cpu" for d in devices):
        return False
    if 0 < nbytes <= TINY_MAX_BYTES:  # any regime: the write is cheaper than handing it to the threads
        return True
    if torch.get_num_threads() < usable_cpus():
        return False
    return memory or 0 < nbytes <= INLINE_MAX_BYTES


def tensors_in(obj: Any, plain_only: bool = False) -> list[torch.Tensor] | None:
    """The tensors in ``obj``'s dicts, lists and tuples; ``plain_only``: None once anything else but a
    str, number, bytes or None turns up (other objects are skipped otherwise)."""
    tensors: list[torch.Tensor] = []
    todo = [obj]
    while todo:
        item = todo.pop()
        if isinstance(item, torch.Tensor):
            tensors.append(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple)):
            todo.extend(item)
        elif plain_only and not isinstance(item, (str, int, float, bool, bytes, type(None))):
            return None
    return tensors


def small_in_save(options: CheckpointerOptions, obj: Any, folder: str) -> bool:
    """Whether a file of ``obj`` saved into ``folder`` is tiny (at most ``TINY_MAX_BYTES`` of tensor data)
    and would be written inside ``save()``, judged before capture from the tensors in plain dicts, lists
    and tuples (any other object: False). An integration writes such files with the framework's writer."""
    tensors = tensors_in(obj, plain_only=True)
    if tensors is None:
        return False
    nbytes = sum(t.untyped_storage().nbytes() for t in tensors)
    if nbytes > TINY_MAX_BYTES:  # larger: lazyckpt's own write in save() is faster
        return False
    return _inline(options, _fs.is_memory_filesystem(folder), [t.device for t in tensors], nbytes)


def _inline(options: CheckpointerOptions, memory: bool, devices: list[torch.device], nbytes: int) -> bool:
    """``write_in_save``, where an explicit ``direct_io=True`` keeps a disk file's O_DIRECT writes (in
    the background) in any regime: ``SavePlan.decide``'s rule, and ``small_in_save``'s."""
    return write_in_save(memory, devices, nbytes) and (memory or options.direct_io is not True)


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def zero_copy_candidate(src: Source, guarded: set[int]) -> bool:
    """A CPU tensor an optimizer owns (so it changes only in a step the guard holds back), large,
    and 64-byte aligned like every CPU allocation of torch's (its file offset must be too)."""
    return (
        src.device.type == "cpu" and src.storage_ptr in guarded
        and src.nbytes >= ZERO_COPY_MIN and src.data_ptr % 64 == 0
    )  # fmt: skip
