"""Remote storage: upload throughput and the stall per checkpoint with an ``s3://`` dirpath.

    python -m benchmarks.bench_remote                          # 512 MB file, ~25M-param GPT
    python -m benchmarks.bench_remote --size-mb 128 --repeats 1 --steps 6   # quicker

(from the repository root, with ``pip install -e .[test,lightning,s3]``: moto[server] is in the test extra)

The S3 API is moto's server, started here in its own process on 127.0.0.1 (a real HTTP server;
its in-memory store and the 2-core machine bound the figures, not a network link).

1. Upload throughput: one checkpoint file of ``--size-mb``, uploaded by lazyckpt's remote tier
   (``SaveStats.upload_s``: the upload stage alone, multipart with ``upload_threads`` parallel parts)
   and by fsspec's own ``put_file`` of the same file to the same server, interleaved, median of
   ``--repeats``. Target (issue 16): lazyckpt >= 0.9 x put.
2. Stall per checkpoint: Trainer.fit with ModelCheckpoint(every_n_train_steps=1, save_top_k=1)
   under no checkpointing, stock TorchCheckpointIO writing to ``s3://``, LazyCheckpointIO writing to
   ``s3://`` and LazyCheckpointIO writing to local disk. Stall = (fit - no-checkpoint fit) / steps;
   fit time includes teardown, where lazyckpt drains (for s3: uploads) its last saves. Target:
   Lazy s3 stall within 10% of Lazy local stall.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import torch


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(endpoint + "/moto-api/", timeout=1).close()
            return proc, endpoint
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise RuntimeError("moto server did not start") from None
            time.sleep(0.1)  # a benchmark's start-up poll, not a test


def storage_options(endpoint: str) -> dict[str, Any]:
    return {"key": "bench", "secret": "bench", "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}}


def bench_upload(endpoint: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    import s3fs

    from lazyckpt import LazyCheckpointer

    opts = storage_options(endpoint)
    fs = s3fs.S3FileSystem(**opts)
    fs.call_s3("create_bucket", Bucket="bench-upload")
    state = {"w": torch.randn(args.size_mb << 18)}
    lazy, put = [], []
    with LazyCheckpointer(
        fsync=False, local_dir=os.path.join(tmp, "tier"), keep_local=True, storage_options=opts,
        upload_threads=args.upload_threads, upload_part_bytes=args.part_mb << 20,
    ) as ck:  # fmt: skip
        for r in range(args.repeats):
            stats = ck.save(state, f"s3://bench-upload/lazy-{r}.pt").wait()
            lazy.append(stats.file_bytes / stats.upload_s / 1e9)
            local = os.path.join(tmp, "tier", "s3", "bench-upload", f"lazy-{r}.pt")
            t = time.perf_counter()
            fs.put_file(local, f"bench-upload/put-{r}.pt")
            put.append(stats.file_bytes / (time.perf_counter() - t) / 1e9)
            fs.rm([f"bench-upload/lazy-{r}.pt", f"bench-upload/put-{r}.pt"])
            os.unlink(local)
    out = {
        "file_gb": stats.file_bytes / 1e9,
        "lazyckpt_gbps": statistics.median(lazy),
        "fsspec_put_gbps": statistics.median(put),
        "per_repeat": {"lazyckpt": lazy, "put": put},
    }
    out["ratio"] = out["lazyckpt_gbps"] / out["fsspec_put_gbps"]
    return out


def bench_stall(endpoint: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    import lightning as L
    import s3fs
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import TorchCheckpointIO

    from examples.lightning_gpt import GPT
    from lazyckpt.lightning import LazyCheckpointIO

    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench",
                      AWS_DEFAULT_REGION="us-east-1")  # fmt: skip
    s3fs.S3FileSystem.clear_instance_cache()
    s3fs.S3FileSystem().call_s3("create_bucket", Bucket="bench-stall")

    seen: dict[str, list[float]] = {"lazy_s3": [], "lazy_local": []}

    def fit(plugin: Any, dirpath: str | None, name: str = "") -> float:
        L.seed_everything(0, verbose=False)
        model = GPT(vocab=args.vocab, dim=args.dim, layers=args.layers, heads=args.dim // 64, seq=args.seq,
                    batch_size=args.batch, steps=args.steps)  # fmt: skip
        ckpt = [ModelCheckpoint(dirpath=dirpath, every_n_train_steps=1, save_top_k=1)] if dirpath else []
        trainer = L.Trainer(
            accelerator="cpu", devices=1, max_epochs=1, logger=False, enable_progress_bar=False,
            enable_model_summary=False, enable_checkpointing=bool(dirpath), callbacks=ckpt,
            plugins=[plugin] if plugin is not None else [],
        )  # fmt: skip
        t = time.perf_counter()
        trainer.fit(model)
        elapsed = time.perf_counter() - t
        if name in seen:  # what training itself waited: inside save_checkpoint plus the step's wait
            seen[name] += [st.blocked_s + st.guard_wait_s for st in plugin.stats]
        return elapsed

    configs = {
        "none": lambda r: (None, None),
        "torch_s3": lambda r: (TorchCheckpointIO(), f"s3://bench-stall/torch-{r}"),
        "lazy_s3": lambda r: (LazyCheckpointIO(fsync=False), f"s3://bench-stall/lazy-{r}"),
        "lazy_local": lambda r: (LazyCheckpointIO(fsync=False), os.path.join(tmp, f"local-{r}")),
    }
    fit(None, None)  # warm-up, not counted
    stalls: dict[str, list[float]] = {k: [] for k in configs if k != "none"}
    names = list(configs)
    for r in range(args.repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        times = {name: fit(*configs[name](r), name) for name in order}
        for name in stalls:
            stalls[name].append((times[name] - times["none"]) / args.steps)
    out: dict[str, Any] = {k: statistics.median(v) for k, v in stalls.items()}
    out["per_repeat"] = stalls
    out["in_training_stall_s"] = {k: statistics.median(v) for k, v in seen.items() if v}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-mb", type=int, default=512)
    p.add_argument("--part-mb", type=int, default=32)
    p.add_argument("--upload-threads", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", choices=["upload", "stall"], default=None)
    args = p.parse_args(argv)
    proc, endpoint = start_moto()
    result: dict[str, Any] = {"torch_threads": torch.get_num_threads()}
    try:
        with tempfile.TemporaryDirectory(prefix="bench-remote-") as tmp:
            if args.skip != "upload":
                result["upload"] = bench_upload(endpoint, args, tmp)
                print(json.dumps({"upload": result["upload"]}), file=sys.stderr)
            if args.skip != "stall":
                result["stall_s"] = bench_stall(endpoint, args, tmp)
    finally:
        proc.kill()
        proc.wait()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
