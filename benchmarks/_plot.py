"""``bench_core --plot FILE.png``: one timeline per mode (matplotlib, imported only here).

Top lane: each training step, green while computing, red while blocked by checkpointing (inside
save(), waiting before the optimizer step, the final drain). Bottom lane: background work
(host copies in orange, file writes in blue). Same time axis for every mode.
"""

from __future__ import annotations

from typing import Any

COLORS = {"compute": "#4caf50", "blocked": "#e53935", "stage": "#fb8c00", "write": "#1e88e5"}
MATPLOTLIB_HINT = "--plot needs matplotlib: pip install matplotlib (or lazyckpt[cli])"


def matplotlib_missing() -> str | None:
    """None when matplotlib can be imported, else what to do about it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return MATPLOTLIB_HINT
    return None


def plot_timelines(doc: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    modes = doc["modes"]
    fig, axes = plt.subplots(len(modes), 1, sharex=True, figsize=(12, 1.0 + 1.3 * len(modes)), squeeze=False)
    for ax, mode in zip(axes[:, 0], modes, strict=True):
        _draw_mode(ax, mode, doc["timeline"][mode], doc["summary"][mode])
    axes[-1, 0].set_xlabel("seconds since the first counted step (last round)")
    handles = [Patch(color=c, label=label) for label, c in (("compute", COLORS["compute"]),
               ("blocked by checkpointing", COLORS["blocked"]), ("background copy to host", COLORS["stage"]),
               ("background file write", COLORS["write"]))]  # fmt: skip
    fig.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.965), ncol=4, frameon=False)
    title = f"{doc['config'].get('n_layer')}x{doc['config'].get('n_embd')} GPT, {doc['facts']['device']}"
    fig.suptitle(f"checkpoint every step: {title}", y=0.995, fontsize=10)
    fig.tight_layout(rect=(0, 0, 1, 0.9))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _draw_mode(ax: Any, mode: str, tl: dict[str, Any], summary: dict[str, Any]) -> None:
    steps = [(s["start"], s["duration"]) for s in tl["steps"]]
    ax.broken_barh(steps, (10, 8), facecolors=COLORS["compute"], edgecolor="white", linewidth=0.5)
    blocked = [(s, e - s) for s, e, _ in tl["blocked"]] + [(tl["drain"][0], tl["drain"][1] - tl["drain"][0])]
    ax.broken_barh(blocked, (10, 8), facecolors=COLORS["blocked"])
    for kind, y in (("stage", 4.5), ("write", 0)):
        spans = [(s, e - s) for s, e, what in tl["background"] if what == kind]
        ax.broken_barh(spans, (y, 4), facecolors=COLORS[kind])
    ax.set_yticks([4.5, 14], ["background", "training"])
    ax.set_ylim(-1, 19)
    stall = summary.get("stall_s")
    ax.set_title(f"{mode}" + ("" if mode == "none" or stall is None else f": stall {stall:.3f} s per checkpoint"),
                 loc="left", fontsize=9)  # fmt: skip
