"""Reading checkpoints back: ``latest()`` (the newest step complete and verified at some level, agreed among
ranks when collective) and ``load()``; ``Found`` is what ``latest()`` returns."""

from lazyckpt.recovery import Found, load

from ._latest import latest, latest_agreed

__all__ = ["Found", "latest", "latest_agreed", "load"]
