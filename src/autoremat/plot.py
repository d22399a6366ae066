"""Plots: the simulated memory timeline of one step, unpatched against planned (matplotlib)."""

from __future__ import annotations

from collections.abc import Mapping

from .graph import Graph
from .plan import Plan
from .cost import simulate

__all__ = ["plot_timelines"]


def plot_timelines(graph: Graph, plans: Mapping[str, Plan], path: str, *, title: str = "") -> str:
    """Write a PNG of live bytes over the events of one step for each plan; returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=120)
    for label, plan in plans.items():
        sim = simulate(graph, plan)
        ys = [live / 2**20 for _phase, _node, live in sim.timeline]
        ax.plot(range(len(ys)), ys, label=f"{label} (peak {sim.peak_bytes / 2**20:.2f} MiB)", linewidth=1.2)
        ax.axhline(sim.peak_bytes / 2**20, linestyle=":", linewidth=0.8, color=ax.lines[-1].get_color())
    ax.set_xlabel("event (forward, loss, recomputation and backward of each node)")
    ax.set_ylabel("live bytes above step start (MiB)")
    ax.set_title(title or f"{graph.meta.get('model', 'model')}: simulated memory during one step")
    ax.legend(loc="upper right", fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
