"""FSDP ``SHARDED_STATE_DICT``: accelerate's ``dcp.save`` calls, routed to a ``DistributedCheckpointer``.

``_compat`` wraps accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` and stands in for
``torch.distributed.checkpoint.save``; for an installed accelerator it hands exactly their call to
:meth:`ShardedRoute.route` (registered with ``_compat.set_route`` by the handle). Each call is saved
lazily, on every process (collective, as ``dcp.save`` is), into the same ``pytorch_model_fsdp_<i>`` /
``optimizer_<i>`` folder, committed whole once every process's part is durable. Inside an installed
``save_state`` the output folder's marker waits for it too (``SaveStateCall.add_sharded``).
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
        """What accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` would save with
        ``dcp.save(state_dict, storage_writer=FileSystemWriter(path))``, lazily, on every process
        (collective, as dcp.save is): the same folder through a ``DistributedCheckpointer``."""
        if self.closed:
            raise RuntimeError("lazyckpt.accelerate: routing a save after uninstall()")  # not reached: unrouted
        call = _compat.active_save.get()
        if not isinstance(call, SaveStateCall) or call.owner is not self.owner:
            call = None
        if call is not None:  # inside an installed save_state: the output folder's marker waits for it too
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

            # The sharded files of one save_state folder: a plain (single-level) distributed save,
            # whatever levels the handle has (its levels copy the whole folder once it is complete).
            opts = dataclasses.replace(self.checkpointer.options, on_backpressure="block", levels=None)
            self._dist = DistributedCheckpointer(options=opts)
        return self._dist
