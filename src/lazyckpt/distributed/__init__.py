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
"""

from lazyckpt.recovery.dcp import verify_checkpoint

from ..errors import DistributedSaveError, DistributedUploadError
from ._checkpointer import DistributedCheckpointer, DistributedSaveHandle

__all__ = [
    "DistributedCheckpointer",
    "DistributedSaveError",
    "DistributedSaveHandle",
    "DistributedUploadError",
    "verify_checkpoint",
]
