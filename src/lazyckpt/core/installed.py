"""The base of every handle an ``install()`` returns: ``uninstall()`` ends the install, ``uninstalled`` says
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
    """Exit hook (``core/exit.py``) of a handle still installed: wait for its pending saves; errors are logged."""
    if handle.uninstalled:
        return
    try:
        handle.wait()
    except BaseException as exc:  # noqa: BLE001 - nobody left to raise to
        logging.getLogger(type(handle).__module__).error("lazyckpt: a checkpoint save failed: %r", exc)
