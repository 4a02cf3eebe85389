"""Memory vs step time, one picture per model: memfit's curve, every peer a labelled point."""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["plot_tradeoff", "pareto"]

MIB = 2**20


def pareto(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no other point beats on both axes (time, memory), sorted by time."""
    front: list[tuple[float, float]] = []
    for t, m in sorted(points):
        if not front or m < front[-1][1]:
            front.append((t, m))
    return front


def plot_tradeoff(result: dict[str, Any], path: str | Path) -> None:
    """Write a PNG: x = median step time (s), y = measured peak activation memory (MiB)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = [r for r in result["methods"] if r.get("step_s") and r.get("peak_bytes")]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=110)
    mem = [(r["step_s"], r["peak_bytes"] / MIB, r) for r in recs if r["family"] == "memfit"
           and not r["info"].get("same_plan_as")]
    if mem:
        front = pareto([(t, m) for t, m, _ in mem])
        ax.plot([t for t, _ in front], [m for _, m in front], "-", color="tab:blue", lw=2,
                label="memfit (measured Pareto front)", zorder=2)
        ax.scatter([t for t, _, _ in mem], [m for _, m, _ in mem], color="tab:blue", s=28, zorder=3,
                   label="memfit plans")
        for t, m, r in mem:
            ax.annotate(r["label"].replace("memfit ", ""), (t, m), textcoords="offset points",
                        xytext=(4, -10), fontsize=7, color="tab:blue")
    markers = {"none": ("k", "s"), "every_block": ("tab:red", "^"), "sqrt_sequential": ("tab:orange", "v"),
               "selective": ("tab:green", "D")}
    for r in recs:
        if r["family"] == "memfit":
            continue
        color, marker = markers.get(r["name"], ("tab:purple", "P"))
        ax.scatter([r["step_s"]], [r["peak_bytes"] / MIB], color=color, marker=marker, s=70, zorder=4,
                   edgecolors="white", linewidths=0.5)
        text = r["label"] + ("" if r.get("grads_equal") in (True, None) else " (grads differ)")
        ax.annotate(text, (r["step_s"], r["peak_bytes"] / MIB), textcoords="offset points",
                    xytext=(6, 4), fontsize=8, color=color)
    ax.set_xlabel("median step time (s)  -> slower")
    ax.set_ylabel("peak activation memory (MiB)  -> more")
    env = result.get("environment", {})
    ax.set_title(f"{result['model']}: {result['description']}\n"
                 f"torch {env.get('torch_version', '?')}, {env.get('threads', '?')} CPU threads", fontsize=9)
    ax.grid(alpha=0.3)
    if mem:
        ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
