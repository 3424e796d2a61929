"""Draw the dashboard's key panels as one PNG from what a real Prometheus answered for a run.

    hack/render_dashboard.py PANELS.json OUT.png [--title TITLE]

PANELS.json is what `make e2e-demo` writes (`--panels-out`, hack/prom_panels.py): the run's
span and, per panel title, its series as Prometheus's `query_range` returned them for the
dashboard's own queries with Grafana's variables substituted:
`{"title", "start", "end", "panels": {title: [[series name, [[t, value], ...]], ...]}}`.
So the picture shows what the Grafana dashboard showed for that run. A panel with no series
says "no data". Time runs in seconds from the run's start.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: write files only
import matplotlib.pyplot as plt  # noqa: E402

from transom_operator import dashboard  # noqa: E402

COLUMNS = 2
# Grafana's units as axis labels (the others are plain numbers).
UNIT_LABELS = {"s": "seconds", "percentunit": "fraction"}


def key_panels() -> list[dashboard.Panel]:
    return [p for p in dashboard.PANELS if p.style == "timeseries"]


Series = list[tuple[str, list[tuple[float, float]]]]


def _draw(ax, panel: dashboard.Panel, series: Series, span: tuple[float, float]) -> None:
    t0, t1 = span
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("seconds", fontsize=8)
    ax.set_ylabel(UNIT_LABELS.get(panel.unit, ""), fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.set_xlim(0, max(t1 - t0, 1.0))  # one time axis for every panel, as on the dashboard
    drawn, named = [], []
    for name, points in sorted(series):
        points = [(t, v) for t, v in points if math.isfinite(v)]  # a quantile of no observations is NaN
        if not points:
            continue
        # A series that stays at zero (a failure reason that never happened) is drawn
        # faint and left out of the legend, as Grafana's "hide zeros": a panel with
        # twenty reasons would otherwise repeat the ten colours of the cycle.
        zero = all(v == 0 for _, v in points)
        ax.plot([t - t0 for t, _ in points], [v for _, v in points], label=None if zero else name,
                linewidth=0.8 if zero else 1.2, color="lightgrey" if zero else None,
                marker="." if len(points) < 3 else None, zorder=1 if zero else 2)
        drawn.append(name)
        named += [] if zero else [name]
    if not drawn:
        ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes, color="grey", fontsize=12)
        return
    bottom, top = ax.get_ylim()
    if not named:  # every series at zero: a plain 0..1 axis, not matplotlib's +-0.05 around the line
        bottom, top = 0.0, 1.0
    ax.set_ylim(panel.min if panel.min is not None else bottom, panel.max * 1.05 if panel.max is not None else top)
    if named and named != ["value"]:  # a lone unnamed series needs no legend
        ax.legend(fontsize=7, loc="best")


def render(series: dict[str, Series], span: tuple[float, float], out: Path, title: str = "Transom") -> None:
    """Write the key panels, COLUMNS to a row, as a PNG."""
    panels = key_panels()
    rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(6 * COLUMNS, 3.2 * rows), squeeze=False)
    for ax, panel in zip(axes.flat, panels):
        _draw(ax, panel, series.get(panel.title, []), span)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.2 * rows)))  # room for the title above the first row
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("panels", type=Path, help="the panels' series, as `make e2e-demo` writes them")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--title", default=None, help="default: the run's namespace/job")
    args = parser.parse_args(argv)
    run = json.loads(args.panels.read_text())
    render(run["panels"], (run["start"], run["end"]), args.out, args.title or f"Transom: {run['title']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
