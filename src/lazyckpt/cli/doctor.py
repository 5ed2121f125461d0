"""``lazyckpt doctor [DIR]``: what this machine offers checkpointing, and how to tune lazyckpt for it.

Reports versions, GPUs (NVML: memory, PCIe link, device-to-host bandwidth), locked-memory limit and
free host memory, and DIR's write speed; with ``--ckpt-gb``, a host memory budget and writer thread
count for a checkpoint of that size. Works without a GPU or NVML. Exit code 1 only when DIR cannot
be probed.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from . import _probe
from ._format import GB, dump_json, fmt, human_bytes

_NETWORK_FS = ("nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "fuse.", "wekafs", "ceph")
_CHUNK = 64 << 20  # LazyCheckpointer's default chunk_bytes


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "doctor",
        help="report GPUs, PCIe, host memory and storage speed; recommend lazyckpt settings",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("dir", nargs="?", default=".", metavar="DIR", help="where checkpoints go (default: .)")
    p.add_argument("--ckpt-gb", type=float, default=None, help="checkpoint size in GB, for recommendations")
    p.add_argument("--probe-mb", type=int, default=256, help="bytes written by the storage probe (default 256 MB)")
    p.add_argument("--json", action="store_true", help="print one JSON document instead of the report")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    if not os.path.isdir(args.dir):
        print(f"lazyckpt doctor: {args.dir} is not a directory; pass the directory your checkpoints go to")
        return 1
    report = collect(args.dir, args.probe_mb << 20, args.ckpt_gb)
    if args.json:
        dump_json(report)
    else:
        print_report(report)
    return 1 if "error" in report["storage"] and "probe_bytes" in report["storage"] else 0


def collect(directory: str, probe_bytes: int, ckpt_gb: float | None) -> dict[str, Any]:
    report: dict[str, Any] = {
        "versions": _probe.versions(),
        "gpus": _probe.gpus(),
        "host": _probe.host(),
        "storage": _probe.storage(directory, probe_bytes),
    }
    if ckpt_gb is not None:
        report["recommendation"] = recommend(ckpt_gb, report)
    report["advice"] = advice(report)
    return report


# recommendations ----------------------------------------------------------------------------------


def recommend(ckpt_gb: float, report: dict[str, Any]) -> dict[str, Any]:
    """Host memory budget and writer threads for checkpoints of ``ckpt_gb`` GB on this machine."""
    from lazyckpt.checkpointer import default_host_memory_budget

    host, store = report["host"], report["storage"]
    ckpt = int(ckpt_gb * GB)
    threads = _writer_threads(store)
    cap = int(0.5 * (host["memory_available"] or host["memory_total"] or 0))
    want = -(-(ckpt + threads * _CHUNK) // _CHUNK) * _CHUNK  # a checkpoint + a chunk per writer, whole chunks
    budget = min(want, cap // _CHUNK * _CHUNK) if cap else want
    rec: dict[str, Any] = {"ckpt_bytes": ckpt, "host_memory_budget": budget, "writer_threads": threads,
                           "default_host_memory_budget": default_host_memory_budget(), "notes": []}  # fmt: skip
    notes = rec["notes"]
    if budget >= want:
        notes.append("a whole checkpoint fits in the host buffers: copies never wait for storage")
    else:
        gbps = _best_gbps(store)
        stall = f" (about {(ckpt - budget) / (gbps * GB):.1f} s per save at {gbps:.2f} GB/s)" if gbps else ""
        notes.append(f"the checkpoint streams through {human_bytes(budget)} of buffers (half the free memory): "
                     f"staging waits for storage{stall}; free host memory or save less often")  # fmt: skip
    gbps = _best_gbps(store)
    if gbps:
        rec["seconds_to_durable"] = ckpt / (gbps * GB)
        notes.append(f"storage takes {rec['seconds_to_durable']:.1f} s to write one checkpoint: save no more often, "
                     "or saves back up (BackpressureWarning; on_backpressure='skip' drops them instead)")  # fmt: skip
    for dev in report["gpus"]["devices"]:
        if dev.get("d2h_expected_gbps"):
            seconds = ckpt / (dev["d2h_expected_gbps"] * GB)
            notes.append(f"GPU {dev['index']}: copying the checkpoint to the host takes about {seconds:.2f} s; "
                         "steps shorter than that wait for the rest at the next optimizer.step()")  # fmt: skip
    return rec


def _writer_threads(store: dict[str, Any]) -> int:
    one, four = store.get("gbps_1_thread"), store.get("gbps_4_threads")
    if not one or not four:
        return 4  # LazyCheckpointer's default
    if four < 1.2 * one:  # parallel writes do not help: two overlap CRC32 and writes
        return 2
    network = any(store["filesystem"].startswith(fs) for fs in _NETWORK_FS)
    return 8 if network and four >= 1.5 * one else 4  # writers wait on I/O: not bounded by CPU count


def _best_gbps(store: dict[str, Any]) -> float | None:
    speeds = [s for s in (store.get("gbps_1_thread"), store.get("gbps_4_threads")) if s]
    return max(speeds) if speeds else None


def advice(report: dict[str, Any]) -> list[str]:
    """What to do next, one line each, from what the probes found."""
    out: list[str] = []
    gpus, host = report["gpus"], report["host"]
    if not gpus["cuda_available"]:
        out.append("no CUDA GPU visible to torch: lazyckpt uses its CPU path (memcpy into host buffers). "
                   "Expected a GPU? Check `nvidia-smi`, CUDA_VISIBLE_DEVICES and that torch is a CUDA build "
                   f"(torch.version.cuda is {report['versions']['torch_cuda']}).")  # fmt: skip
        if gpus["devices"]:
            out.append("NVML sees GPUs but torch cannot use them: install a CUDA build of torch.")
    if not gpus["nvml"]["ok"]:
        out.append(f"no GPU details: {gpus['nvml']['error']}.")
    for dev in gpus["devices"]:
        link = dev.get("pcie") or {}
        if link.get("gen_current") and link.get("gen_max") and link["gen_current"] < link["gen_max"]:
            out.append(f"GPU {dev['index']} link runs at Gen{link['gen_current']} now (Gen{link['gen_max']} max): "
                       "idle GPUs train down to save power; check again under load.")  # fmt: skip
    budget = report.get("recommendation", {}).get("host_memory_budget")
    if gpus["cuda_available"] and host["memlock_soft"] is not None and budget and host["memlock_soft"] < budget:
        out.append(f"locked-memory limit (ulimit -l) is {human_bytes(host['memlock_soft'])}: if pinning host "
                   "buffers fails, raise it (`ulimit -l unlimited`; docker: --ulimit memlock=-1).")  # fmt: skip
    if report["storage"].get("error"):
        out.append(f"storage: {report['storage']['error']}.")
    if "recommendation" not in report:
        out.append("pass --ckpt-gb SIZE (your checkpoint's size, see `lazyckpt inspect`) for recommended settings.")
    return out


# terminal output ----------------------------------------------------------------------------------


def print_report(report: dict[str, Any]) -> None:
    v = report["versions"]
    _section("versions")
    for key in ("python", "lazyckpt", "torch", "torch_cuda", "lightning", "accelerate", "safetensors",
                "nvidia-ml-py", "crc32"):  # fmt: skip
        _item(key, v.get(key) or ("none (CPU-only torch build)" if key == "torch_cuda" else "not installed"))
    _print_gpus(report["gpus"])
    h = report["host"]
    _section("host")
    _item("memory", f"{human_bytes(h['memory_available'])} available of {human_bytes(h['memory_total'])}")
    _item("locked memory (ulimit -l)", "unlimited" if h["memlock_soft"] is None else human_bytes(h["memlock_soft"]))
    _item("CPUs usable", h["cpus"])
    _print_storage(report["storage"])
    if "recommendation" in report:
        _print_recommendation(report["recommendation"])
    if report["advice"]:
        _section("what to do next")
        for line in report["advice"]:
            print(f"  - {line}")


def _print_gpus(g: dict[str, Any]) -> None:
    _section("GPUs")
    _item("CUDA (torch)", f"{g['torch_devices']} device(s)" if g["cuda_available"] else "not available")
    _item("NVML", f"driver {g['nvml'].get('driver')}" if g["nvml"]["ok"] else g["nvml"]["error"])
    for d in g["devices"]:
        _item(f"GPU {d['index']}", f"{d['name']}, {human_bytes(d.get('memory_total'))}")
        link = d.get("pcie")
        if link:
            _item("  PCIe", f"Gen{link['gen_current']} x{link['width_current']} now, "
                            f"Gen{link['gen_max']} x{link['width_max']} max")  # fmt: skip
        if d.get("d2h_link_gbps"):
            _item("  device-to-host", f"{d['d2h_link_gbps']:.1f} GB/s link, ~{d['d2h_expected_gbps']:.0f} GB/s "
                                      "expected for pinned copies")  # fmt: skip


def _print_storage(s: dict[str, Any]) -> None:
    _section("storage")
    _item("directory", s["dir"])
    _item("filesystem", s["filesystem"])
    _item("free", human_bytes(s["free_bytes"]))
    if "gbps_1_thread" in s:
        _item("write + fsync", f"{fmt(s['gbps_1_thread'])} GB/s (1 thread), {fmt(s['gbps_4_threads'])} GB/s "
                               f"(4 threads), {human_bytes(s['probe_bytes'])} probe")  # fmt: skip


def _print_recommendation(r: dict[str, Any]) -> None:
    _section(f"recommended for a {human_bytes(r['ckpt_bytes'])} checkpoint")
    mib = r["host_memory_budget"] >> 20
    print(f"  LazyCheckpointer(host_memory_budget={mib} << 20, writer_threads={r['writer_threads']})")
    print(f"  ({human_bytes(r['host_memory_budget'])} of host buffers; the default budget here is "
          f"{human_bytes(r['default_host_memory_budget'])})")  # fmt: skip
    for note in r["notes"]:
        print(f"  - {note}")


def _section(title: str) -> None:
    print(f"\n{title}" if title != "versions" else title)


def _item(key: str, value: Any) -> None:
    print(f"  {key + ':':<27} {value}")
