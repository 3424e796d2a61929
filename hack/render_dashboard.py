"""Draw the dashboard's key panels as one PNG from a run's recorded /metrics scrapes.

    hack/render_dashboard.py SCRAPES.jsonl OUT.png [--title TITLE] [--rate-window SECONDS]

SCRAPES.jsonl holds one scrape per line, as the e2e tests record them:
`{"t": <unix seconds>, "source": "operator" | "coordinator", "text": "<Prometheus text>"}`.
The panels and their queries are the ones of the Grafana dashboard
(`transom_operator.dashboard.PANELS`, its timeseries panels), evaluated in Python by
`dashboard.evaluate`, so the picture shows what the dashboard would for that run. A panel
with no series says "no data". Time runs in seconds from the first scrape.
"""

from __future__ import annotations

import argparse
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


def _draw(ax, panel: dashboard.Panel, scrapes: list[dashboard.Scrape], span: tuple[float, float],
          rate_window_s: float | None) -> None:
    t0, t1 = span
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("seconds", fontsize=8)
    ax.set_ylabel(UNIT_LABELS.get(panel.unit, ""), fontsize=8)
    ax.tick_params(labelsize=8)
    ax.grid(alpha=0.3)
    ax.set_xlim(0, max(t1 - t0, 1.0))  # one time axis for every panel, as on the dashboard
    drawn, named = [], []
    for query in panel.queries:
        for name, points in dashboard.evaluate(query, scrapes, rate_window_s).items():
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


def render(scrapes: list[dashboard.Scrape], out: Path, title: str = "Transom",
           rate_window_s: float | None = None) -> None:
    """Write the key panels, COLUMNS to a row, as a PNG."""
    panels = key_panels()
    rows = math.ceil(len(panels) / COLUMNS)
    fig, axes = plt.subplots(rows, COLUMNS, figsize=(6 * COLUMNS, 3.2 * rows), squeeze=False)
    span = (scrapes[0].t, scrapes[-1].t) if scrapes else (0.0, 0.0)
    for ax, panel in zip(axes.flat, panels):
        _draw(ax, panel, scrapes, span, rate_window_s)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.35 / (3.2 * rows)))  # room for the title above the first row
    fig.savefig(out, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scrapes", type=Path, help="JSON lines of recorded scrapes")
    parser.add_argument("out", type=Path, help="the PNG to write")
    parser.add_argument("--title", default="Transom")
    parser.add_argument("--rate-window", type=float, default=None,
                        help="seconds that stand for $__rate_interval (default: four scrape intervals)")
    args = parser.parse_args(argv)
    with args.scrapes.open() as f:
        scrapes = dashboard.load_recording(f)
    render(scrapes, args.out, args.title, args.rate_window)
    return 0


if __name__ == "__main__":
    sys.exit(main())
