"""FSDP ``SHARDED_STATE_DICT``: accelerate's ``dcp.save`` calls (intercepted by ``_compat``), saved lazily
through a ``DistributedCheckpointer`` into the same folders, each committed whole once every process's part
is durable. Inside an installed ``save_state`` the output folder's marker waits for them too.
"""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING, Any

from lazyckpt.accelerate import _compat
from lazyckpt.accelerate._folder_save import SaveStateCall

if TYPE_CHECKING:
    from lazyckpt import LazyCheckpointer
    from lazyckpt.distributed import DistributedCheckpointer


class ShardedRoute:
    """One handle's sharded saves: the ``DistributedCheckpointer`` (made at the first one) they go to."""

    def __init__(self, owner: object, checkpointer: LazyCheckpointer) -> None:
        self.owner = owner
        self.checkpointer = checkpointer  # whose options the distributed checkpointer takes
        self.closed = False
        self._dist: DistributedCheckpointer | None = None

    def route(self, state_dict: dict[str, Any], path: str) -> None:
        """Save lazily what ``dcp.save(state_dict, storage_writer=FileSystemWriter(path))`` would (collective,
        every process, as dcp.save is)."""
        if self.closed:
            raise RuntimeError("lazyckpt.accelerate: routing a save after uninstall()")  # unrouted by then
        call = _compat.active_save.get()
        if not isinstance(call, SaveStateCall) or call.owner is not self.owner:
            call = None
        if call is not None:  # inside an installed save_state: its marker waits for it too
            call.begin(os.path.dirname(os.path.abspath(path)))
        handle = self._checkpointer().save(state_dict, path)
        if call is not None:
            call.add_sharded(handle)

    def wait(self, timeout: float | None = None) -> None:
        """Every sharded save committed on every process (or its error raised)."""
        if self._dist is not None:
            self._dist.wait(timeout)

    def close(self) -> None:
        self.closed = True
        if self._dist is not None:
            dist_ckpt, self._dist = self._dist, None
            dist_ckpt.close()

    def _checkpointer(self) -> DistributedCheckpointer:
        if self._dist is None:
            from lazyckpt.distributed import DistributedCheckpointer

            # Single-level: the handle's levels copy the whole folder once it is complete.
            opts = dataclasses.replace(self.checkpointer.options, on_backpressure="block", levels=None)
            self._dist = DistributedCheckpointer(options=opts)
        return self._dist
