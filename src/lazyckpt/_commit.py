"""Old name of :mod:`lazyckpt._fs`, kept so existing imports keep working.

This module *is* ``lazyckpt._fs`` (the same module object), so a test that replaces
``lazyckpt._commit.discard`` replaces what the engine calls.
"""

import sys

from . import _fs

sys.modules[__name__] = _fs
