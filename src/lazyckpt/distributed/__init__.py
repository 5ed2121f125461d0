"""Lazy sharded checkpoints across ranks, in DCP's on-disk format, with a multi-rank atomic commit.

```python
from lazyckpt.distributed import DistributedCheckpointer

ckpt = DistributedCheckpointer()                 # every rank, after init_process_group
h = ckpt.save({"model": msd, "optim": osd, "step": step}, "ckpt/step-100")   # collective
...                                              # forward, backward, optimizer.step()
h.wait()                                         # committed on every rank
ckpt.close()
```

The folder is a ``torch.distributed.checkpoint`` checkpoint (``dcp.load`` reads it with any world
size); ``verify_checkpoint(path)`` checks it against the sizes and CRCs recorded at save time.

``path`` may be a URL (``s3://bucket/run/step-100``, any fsspec URL): every rank saves its file on
local disk as above, uploads it in the background, and the coordinator uploads ``.metadata`` last,
once every rank's file is in the store (``FsspecReader`` reads it; a failed upload raises
``DistributedUploadError`` on every rank and leaves no ``.metadata``).

Multi-level checkpoints (every step to node memory, fewer to disk and object storage):

```python
import lazyckpt
from lazyckpt import Level

levels = [
    Level("/dev/shm/run1", every=1, keep=2),         # node memory: each node its own folder
    Level("/shared/ckpt/run1", every=10, keep=3),     # a disk every rank sees
    Level("s3://bucket/run1", every=100),             # object storage
]
ckpt = DistributedCheckpointer(levels=levels)      # collective: finds which ranks share each folder
h = ckpt.save({"model": msd, "optim": osd}, step=step)   # collective; one handle
...
found = lazyckpt.latest(levels)                    # on every rank at restart: the same step everywhere
if found:                                          # found.path: this rank's fastest copy it can load
    dcp.load(state, checkpoint_id=found.path)      # (a URL: storage_reader=FsspecReader(found.path, ...))
```

Each due level gets a DCP folder ``<level>/step-<n, 8 digits>``; a level whose folder differs per
node (tmpfs) holds, per node, that node's ranks' files and a ``.metadata`` locating them (replicated
items are kept once per node, not once per job), so a job restarted with the same layout reloads
every rank's shard from its node's memory; a shared level's folder is a whole checkpoint that
``dcp.load`` reads with any world size. Each save stages the tensors once, into the fastest due
level; the slower ones are fed from that level's committed files by background threads, each
rank copying (CRC-checked) or uploading its own file; each level folder is committed on every rank
or none. A level's failure is a ``DistributedLevelError`` naming the level (and the ranks), raised
alike on every rank; the other levels go on.
"""

from lazyckpt.recovery.dcp import verify_checkpoint

from ..errors import DistributedLevelError, DistributedSaveError, DistributedUploadError
from ._checkpointer import DistributedCheckpointer, DistributedSaveHandle

__all__ = [
    "DistributedCheckpointer",
    "DistributedLevelError",
    "DistributedSaveError",
    "DistributedSaveHandle",
    "DistributedUploadError",
    "verify_checkpoint",
]

# Shared with the integrations, not public API: the store heartbeat (Accelerate across nodes uses it).
from ._commit import DEAD_AFTER_S as DEAD_AFTER_S  # noqa: E402
from ._commit import Liveness as Liveness  # noqa: E402
