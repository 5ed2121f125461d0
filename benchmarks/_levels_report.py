"""The tables and target lines that ``benchmarks.bench_levels`` prints."""

from __future__ import annotations

from typing import Any

from lazyckpt.cli._format import fmt, human_bytes, table

PEERS = ("torch.save", "dcp", "lazy-disk", "lazy-mem")  # the ratio columns


def print_report(doc: dict[str, Any]) -> None:
    if "training" in doc:
        _print_training(doc["training"])
    if "resume" in doc:
        _print_resume(doc["resume"])


def _print_training(t: dict[str, Any]) -> None:
    lv, modes = t["levels"], t["modes"]
    print(
        f"checkpoint every step: {t['options']['size']} GPT ({t['params'] / 1e6:.1f}M params, "
        f"{human_bytes(t['ckpt_tensor_bytes'])}), {t['facts']['torch_threads']} torch thread(s) on "
        f"{t['facts']['cpus']} CPUs, {t['steps']} counted steps x {t['rounds']} rounds, medians"
    )
    peers = [p for p in PEERS if p in modes]
    headers = [
        "mode",
        "step s",
        "steady stall/step s",
        "one-time drain s",
        "stall/step incl. drain s",
        "train CPU s",
        *[f"vs {p}" for p in peers],
    ]
    rows = []
    for m in modes:
        s = lv[m]
        ratios = ["" if m in ("none", p) else _ratio(s["steady_stall_s"], s["vs"].get(p)) for p in peers]
        rows.append(
            [
                m,
                fmt(s["step_s"]),
                fmt(s["steady_stall_s"], 3),
                fmt(s["drain_s"]),
                fmt(s["stall_with_drain_s"], 3),
                fmt(s["train_cpu_s"]),
                *ratios,
            ]
        )
    table(headers, rows)
    disk = lv.get("disk_write")
    if disk:
        print(
            f"disk: write + fsync of one checkpoint's bytes ({human_bytes(disk['bytes'])}): {disk['s']:.2f} s "
            f"({fmt(disk['gbps'])} GB/s, {t['facts']['filesystem']})"
        )
    _print_targets(lv, t["facts"]["torch_threads"] < t["facts"]["cpus"])
    pressure = t["facts"].get("cpu_pressure")
    if pressure is not None and pressure > 0.2:
        print(f"warning: some task waited for a CPU {pressure:.0%} of the time: a busy machine, noisy numbers")
    print(
        "# steady stall/step: extra time per step vs no checkpointing, the final drain left out; vs X: this "
        "steady stall / X's (lower is better); one-time drain: the wait for the last saves after the last step"
    )


def _print_targets(lv: dict[str, Any], spare: bool) -> None:
    both, mem = lv.get("lazy-mem+disk"), lv.get("lazy-mem")
    floor = lv.get("copy-only")
    if floor is not None:
        print(
            f"memory floor (copy-only: the state's bytes copied into a reused tmpfs file each step, nothing else): "
            f"{floor['steady_stall_s']:.3f} s steady stall per step, {floor['extra_cpu_s']:.2f} background CPU s"
        )
        for name in ("lazy-mem", "lazy-mem+disk"):
            if name in lv:
                above = lv[name]["steady_stall_s"] - floor["steady_stall_s"]
                print(f"  {name} above that floor: {above:+.3f} s per step")
    if both is None:
        return
    vs = both["vs"]
    stall = both["steady_stall_s"]
    if spare:
        for peer, target in (("torch.save", 0.05), ("dcp", 0.2)):
            if peer in lv:
                print(f"lazy-mem+disk vs {peer}: {_ratio(stall, vs.get(peer))} (target <= {target}x, spare core)")
        if mem is not None:
            print(
                f"lazy-mem+disk vs lazy-mem: {_ratio(stall, vs.get('lazy-mem'))}, "
                f"{stall - mem['steady_stall_s']:+.3f} s per step (target: within 10%: the disk level hidden)"
            )
    elif "torch.save" in lv:
        print(f"lazy-mem+disk vs torch.save: {_ratio(stall, vs.get('torch.save'))} (target <= 1x, busy)")
    for name in ("lazy-mem", "lazy-mem+disk"):
        if name in lv and f"{name}-fresh" in lv:
            print(
                f"page reuse ({name}): {lv[name]['steady_stall_s']:.3f} s steady stall per step, "
                f"{lv[f'{name}-fresh']['steady_stall_s']:.3f} s with a new tmpfs file each time (reuse_pages=False)"
            )
        if name in lv and f"{name}-staged" in lv:
            print(
                f"zero copy to tmpfs ({name}): {lv[name]['steady_stall_s']:.3f} s steady stall per step, "
                f"{lv[f'{name}-staged']['steady_stall_s']:.3f} s staging every tensor first (zero_copy=False)"
            )
    inline = lv.get("lazy-mem+disk-inline")
    if inline is not None:
        print(
            f"the disk copy's placement: in the background {both['steady_stall_s']:.3f} s, on the training "
            f"thread {inline['steady_stall_s']:.3f} s steady stall per step"
        )


def _print_resume(r: dict[str, Any]) -> None:
    s = r["summary"]
    dropped = all(v["page_cache_dropped"] for v in s.values())
    print(
        f"\nresume: latest() + load() + load_state_dict (model, AdamW) in a fresh process, one "
        f"{human_bytes(r['bytes'])} checkpoint; page cache {'dropped' if dropped else 'NOT dropped'} "
        "before each; medians over rounds"
    )
    phase_names = [p for p in ("latest", "load", "model.load_state_dict", "optimizer.load_state_dict")]
    headers = [
        "case",
        "resume s",
        "CPU s",
        *[f"{p} s" for p in phase_names],
        "first step extra s",
        "to step s",
        "vs torch.load disk",
        "vs torch.load /dev/shm",
    ]
    rows = []
    for name, v in s.items():
        rows.append(
            [
                name,
                fmt(v["resume_s"], 3),
                fmt(v["cpu_s"], 3),
                *[fmt(v["phases"].get(p), 3) if p in v["phases"] else "" for p in phase_names],
                fmt(v["first_step_extra_s"]),
                fmt(v.get("to_step_s"), 3),
                _speed(v.get("speedup vs torch.load disk")),
                _speed(v.get("speedup vs torch.load /dev/shm")),
            ]
        )
    table(headers, rows)
    for name, target in (("lazyckpt memory", 5.0), ("lazyckpt disk", 1.5)):
        sp = s.get(name, {}).get("speedup vs torch.load disk")
        if sp is not None:
            print(f"{name}: {sp:.2f}x faster than torch.load from disk to the first step's end (target >= {target:g}x)")
    for level in ("memory", "disk"):
        one, many = s.get(f"lazyckpt {level}, 1 reader"), s.get(f"lazyckpt {level}")
        if one and many:
            print(
                f"parallel reads, {level}: {one['resume_s']:.3f} s with 1 reader, {many['resume_s']:.3f} s with the "
                f"default ({'8, at most the usable CPUs on tmpfs' if level == 'memory' else '8'}): "
                f"{one['resume_s'] / many['resume_s']:.2f}x"
            )
    print(
        "# to step: resume s + first step extra, i.e. to the end of the first optimizer step less one steady step; "
        "vs X: X's to-step time / this one's (higher is faster); first step extra: the first training step after "
        "the resume minus the median of the next three (a mapped file: the optimizer's first step copies its pages)"
    )


def _ratio(stall: float | None, x: float | None) -> str:
    if stall is not None and stall <= 0:
        return "~0"
    return "n/a" if x is None else f"{x:.3f}x"


def _speed(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}x"
