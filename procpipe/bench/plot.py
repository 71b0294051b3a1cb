"""``python -m procpipe.bench --plot FILE.png``: throughput and consumer wait % against workers."""

from __future__ import annotations

from typing import Any


def plot(runs: list[dict[str, Any]], path: str) -> None:
    """Throughput and consumer wait % against workers, one panel per run (matplotlib, Agg)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise SystemExit("--plot needs matplotlib: pip install 'procpipe[plot]'") from exc
    fig = Figure(figsize=(7.0, 3.0 * len(runs)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(runs), 1, squeeze=False)[:, 0]
    for ax, run in zip(axes, runs, strict=True):
        settings = run["settings"]
        ws = [s["workers"] for s in settings]
        ax.plot(ws, [s["samples_per_s"] for s in settings], "o-", color="tab:blue", label="samples/s")
        ax.set_ylabel("samples/s", color="tab:blue")
        ax.set_ylim(bottom=0)
        ax.set_xticks(ws)
        ax2 = ax.twinx()
        ax2.plot(ws, [s["wait_pct"] for s in settings], "s--", color="tab:red", label="consumer wait %")
        ax2.set_ylabel("consumer wait %", color="tab:red")
        ax2.set_ylim(0, 105)
        rec = run["recommendation"]["workers"]
        ax.axvline(rec, color="gray", linestyle=":", label=f"recommended: {rec}")
        ax.set_title(run["name"])
        handles = ax.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
        ax.legend(handles=handles, loc="lower right", fontsize="small")
    axes[-1].set_xlabel("workers")
    fig.savefig(path, dpi=100)
