"""Facts about this machine for ``lazyckpt doctor``: versions, GPUs (NVML), host memory, storage speed.

Every probe returns a JSON-ready dict and never raises for a missing piece (reported under ``"error"``).
"""

from __future__ import annotations

import os
import platform
import resource
import shutil
import threading
import time
from importlib import metadata
from typing import Any

# PCIe payload bandwidth per lane and direction after line encoding, GB/s
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
# share of the link a pinned device-to-host copy reaches
PCIE_EFFICIENCY = 0.8
_NVML_HINT = "pip install nvidia-ml-py (or lazyckpt[cli])"


def versions() -> dict[str, Any]:
    import torch

    from lazyckpt import __version__
    from lazyckpt.formats.crc import CRC_IMPL

    out: dict[str, Any] = {"python": platform.python_version(), "lazyckpt": __version__, "torch": torch.__version__,
                           "torch_cuda": torch.version.cuda, "crc32": CRC_IMPL}  # fmt: skip
    for name, dists in (("lightning", ("lightning", "pytorch-lightning")), ("accelerate", ("accelerate",)),
                        ("safetensors", ("safetensors",)), ("nvidia-ml-py", ("nvidia-ml-py",))):  # fmt: skip
        out[name] = next((v for v in map(_dist_version, dists) if v), None)
    return out


def _dist_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


# GPUs ---------------------------------------------------------------------------------------------


def gpus() -> dict[str, Any]:
    """CUDA as torch sees it, and each GPU as NVML describes it (PCIe link, memory)."""
    import torch

    out: dict[str, Any] = {"cuda_available": torch.cuda.is_available(), "torch_devices": 0, "devices": []}
    if out["cuda_available"]:
        out["torch_devices"] = torch.cuda.device_count()
    out["nvml"] = _nvml_devices(out["devices"])
    if not out["devices"] and out["cuda_available"]:  # no NVML: what torch alone can tell
        for i in range(out["torch_devices"]):
            props = torch.cuda.get_device_properties(i)
            out["devices"].append({"index": i, "name": props.name, "memory_total": props.total_memory})
    return out


def _nvml_devices(devices: list[dict[str, Any]]) -> dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        return {"ok": False, "error": f"nvidia-ml-py is not installed ({_NVML_HINT})"}
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return {"ok": False, "error": f"NVML did not start: {exc} (no NVIDIA driver on this machine?)"}
    try:
        driver = _nvml_call(pynvml.nvmlSystemGetDriverVersion)
        for i in range(pynvml.nvmlDeviceGetCount()):
            devices.append(_nvml_device(pynvml, i))
    except Exception as exc:
        return {"ok": False, "error": f"NVML query failed: {exc}"}
    finally:
        _nvml_call(pynvml.nvmlShutdown)
    return {"ok": True, "error": None, "driver": driver}


def _nvml_device(pynvml: Any, index: int) -> dict[str, Any]:
    h = pynvml.nvmlDeviceGetHandleByIndex(index)
    mem = _nvml_call(pynvml.nvmlDeviceGetMemoryInfo, h)
    link = {
        "gen_current": _nvml_call(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, h),
        "width_current": _nvml_call(pynvml.nvmlDeviceGetCurrPcieLinkWidth, h),
        "gen_max": _nvml_call(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, h),
        "width_max": _nvml_call(pynvml.nvmlDeviceGetMaxPcieLinkWidth, h),
    }
    gen, width = link["gen_max"] or link["gen_current"], link["width_max"] or link["width_current"]
    link_gbps = PCIE_LANE_GBPS.get(int(gen), 0.0) * int(width) if gen and width else None
    return {
        "index": index,
        "name": _text(_nvml_call(pynvml.nvmlDeviceGetName, h)),
        "memory_total": getattr(mem, "total", None),
        "memory_free": getattr(mem, "free", None),
        "pcie": link,
        "d2h_link_gbps": link_gbps,
        "d2h_expected_gbps": None if link_gbps is None else link_gbps * PCIE_EFFICIENCY,
    }


def _nvml_call(fn: Any, *args: Any) -> Any:
    """One NVML query; None where the GPU does not support it (MIG slices, some SXM boards)."""
    try:
        return _text(fn(*args))
    except Exception:
        return None


def _text(value: Any) -> Any:
    return value.decode() if isinstance(value, bytes) else value


# host -----------------------------------------------------------------------------------------------


def host() -> dict[str, Any]:
    """Physical / available memory, the locked-memory limit, usable CPUs."""
    meminfo = _meminfo()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = resource.RLIM_INFINITY
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return {
        "memory_total": meminfo.get("MemTotal"),
        "memory_available": meminfo.get("MemAvailable"),
        "memlock_soft": None if soft == unlimited else soft,  # None: unlimited
        "memlock_hard": None if hard == unlimited else hard,
        "cpus": cpus,
    }


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                key, _, rest = line.partition(":")
                out[key] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        out = {"MemTotal": pages * size}
    return out


# storage --------------------------------------------------------------------------------------------


def storage(directory: str, probe_bytes: int) -> dict[str, Any]:
    """Filesystem, free space and a write probe with fsync (one thread vs four, best of two)."""
    path = os.path.abspath(directory)
    out: dict[str, Any] = {"dir": path, "filesystem": filesystem_of(path), "free_bytes": shutil.disk_usage(path).free}
    if out["free_bytes"] < 3 * probe_bytes:
        out["error"] = f"only {out['free_bytes']} bytes free: write probe skipped"
        return out
    buf = _payload(probe_bytes)
    try:
        out["probe_bytes"] = probe_bytes
        best = {1: float("inf"), 4: float("inf")}
        for _ in range(2):  # best of two: a first write is often slow
            for threads in best:
                best[threads] = min(best[threads], _timed_write(path, buf, threads))
        out["gbps_1_thread"], out["gbps_4_threads"] = (probe_bytes / best[n] / 1e9 for n in (1, 4))
    except OSError as exc:
        out["error"] = f"cannot write to {path}: {exc.strerror or exc}"
    return out


def filesystem_of(path: str) -> str:
    """``"ext4 on /dev/sda1 (/)"``: the mount holding ``path`` (longest matching mount point)."""
    best = ("", "unknown")
    try:
        with open("/proc/mounts") as fh:
            for line in fh:
                dev, mnt, fstype = line.split()[:3]
                inside = path == mnt or path.startswith(mnt.rstrip("/") + "/")
                if inside and len(mnt) >= len(best[0]):
                    best = (mnt, f"{fstype} on {dev} ({mnt})")
    except OSError:
        pass
    return best[1]


def _payload(nbytes: int) -> bytearray:
    block = os.urandom(min(nbytes, 4 << 20))  # incompressible
    buf = bytearray(nbytes)
    for off in range(0, nbytes, len(block)):
        buf[off : off + len(block)] = block[: nbytes - off]
    return buf


def _timed_write(directory: str, buf: bytearray, threads: int, chunk: int = 16 << 20) -> float:
    """Seconds to pwrite ``buf`` into a new file with ``threads`` threads, fsync and close it."""
    from lazyckpt.storage.fs import temporary_path  # removable by cleanup_temporaries()

    tmp = temporary_path(os.path.join(directory, "doctor-probe"))
    view, part = memoryview(buf), -(-len(buf) // threads)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    errors: list[OSError] = []

    def write(start: int) -> None:
        try:
            for off in range(start, min(start + part, len(buf)), chunk):
                os.pwrite(fd, view[off : min(off + chunk, start + part, len(buf))], off)
        except OSError as exc:
            errors.append(exc)

    try:
        t0 = time.perf_counter()
        workers = [
            threading.Thread(target=write, args=(i * part,), name=f"lazyckpt-doctor-{i}") for i in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
        os.fsync(fd)
        return time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(tmp)
