"""Every Python process of the DeepSpeed suite (the test processes DeepSpeed's harness spawns too):
lazyckpt injected when $LAZYCKPT_UPSTREAM_MODE=lazy (``lazyckpt_upstream_deepspeed.inject``)."""

import os

if os.environ.get("LAZYCKPT_UPSTREAM_MODE") == "lazy":
    import lazyckpt_upstream_deepspeed

    lazyckpt_upstream_deepspeed.inject()
