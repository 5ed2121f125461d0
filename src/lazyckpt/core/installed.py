"""What every handle an ``install()`` returns shares: the lifecycle verbs of docs/ARCHITECTURE.md
("Lifecycle vocabulary"). ``uninstall()`` (each handle's own) ends the install, ``uninstalled`` says
whether it ran."""

from __future__ import annotations

import logging


class InstalledHandle:
    """Base of ``AccelerateHandle`` and ``TransformersHandle``: a subclass defines ``uninstall()`` and
    sets ``_removed`` once it ran."""

    _removed: bool = False

    def uninstall(self) -> None:
        raise NotImplementedError

    def wait(self, timeout: float | None = None) -> None:
        raise NotImplementedError

    @property
    def uninstalled(self) -> bool:
        """True once ``uninstall()`` ran: the framework saves as stock again."""
        return self._removed


def drain_at_exit(handle: InstalledHandle) -> None:
    """The exit hook of a handle still installed (``core/exit.py``): its pending saves durable before
    the interpreter goes; an error is logged, there is nobody left to raise it to."""
    if handle.uninstalled:
        return
    try:
        handle.wait()
    except BaseException as exc:  # noqa: BLE001 - nobody left to raise to
        logging.getLogger(type(handle).__module__).error("lazyckpt: a checkpoint save failed: %r", exc)
