"""What ``install()`` puts on an Accelerator, and how ``uninstall()`` takes it off again.

On the instance: ``save_state`` / ``load_state`` attributes calling the handle's and a save-state pre-hook
that runs first; process-wide (reference counted): ``_compat.acquire_patch``. At most one handle per
accelerator (:func:`installed`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from lazyckpt.accelerate import _compat

_installed: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()  # accelerator -> its handle


def installed(accelerator: Any) -> Any:
    """The handle installed on ``accelerator`` (not yet removed), or None."""
    return _installed.get(accelerator)


class InstancePatch:
    """``install()``'s changes to one accelerator for ``owner`` (its handle): applied at construction
    (undone if that fails), undone by :meth:`undo`. ``stock_save_state`` / ``stock_load_state``: what
    those names resolved to before. Raises ``RuntimeError`` if a handle is already installed."""

    def __init__(
        self,
        accelerator: Any,
        owner: object,
        *,
        save_state: Callable[..., Any],
        load_state: Callable[..., Any],
        pre_hook: Callable[[list[Any], list[Any], str], None],
        route: _compat.DcpRoute,
    ) -> None:
        if installed(accelerator) is not None:
            raise RuntimeError("lazyckpt.accelerate is already installed on this Accelerator; call uninstall() first")
        self.accelerator = accelerator
        self.owner = owner
        self.stock_save_state = accelerator.save_state
        self.stock_load_state = accelerator.load_state
        # Instance attributes the accelerator already had: restored by undo().
        self._previous = {n: vars(accelerator)[n] for n in ("save_state", "load_state") if n in vars(accelerator)}
        self._methods: dict[str, _compat.InstalledMethod] = {}
        self._hook: Any = None
        self._route = route
        self._process_patched = False
        try:
            self._apply(save_state, load_state, pre_hook)
        except BaseException:
            self.undo()
            raise

    def _apply(
        self,
        save_state: Callable[..., Any],
        load_state: Callable[..., Any],
        pre_hook: Callable[[list[Any], list[Any], str], None],
    ) -> None:
        acc = self.accelerator
        hook = acc.register_save_state_pre_hook(_compat.InstalledPreHook(pre_hook))
        self._hook = hook
        # Run first, so the pending marker exists before any user hook or accelerate writes a file.
        acc._save_model_state_pre_hook.move_to_end(hook.id, last=False)
        _compat.acquire_patch()
        self._process_patched = True
        for name, method in (("save_state", save_state), ("load_state", load_state)):
            attr = _compat.InstalledMethod(method, acc, name, self._previous.get(name))
            self._methods[name] = attr
            setattr(acc, name, attr)
        _compat.set_route(acc, self._route)
        _installed[acc] = self.owner

    def undo(self) -> None:
        """Back to stock: the instance's attributes as they were, hook removed, process patch released."""
        acc = self.accelerator
        for name, ours in self._methods.items():
            if vars(acc).get(name) is ours:  # (left alone when somebody replaced it after install)
                if name in self._previous:
                    setattr(acc, name, self._previous[name])
                else:
                    delattr(acc, name)
        self._methods.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        _compat.drop_route(acc, self._route)
        if self._process_patched:
            self._process_patched = False
            _compat.release_patch()
        if _installed.get(acc) is self.owner:
            del _installed[acc]
