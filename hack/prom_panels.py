"""Read the dashboard's panels and the chart's alerts from the test environment's real
Prometheus (testenv/prometheus.py), as Grafana would: every panel's PromQL with Grafana's
variables and macros substituted, over a time range, through the API server's service proxy.

    panels = panel_series(kubectl, "e2e-demo", "tiny-gpt-cpu", start, end)
    {title: [(series name, [(t, value), ...]), ...]}

`hack/e2e_demo.py` counts the panels with data and the alerts that fired; `render_dashboard.py`
draws the docs picture from the same series.
"""

from __future__ import annotations

import json
import urllib.parse
from collections.abc import Callable

from testenv import prometheus
from transom_operator import dashboard

Series = list[tuple[dict[str, str], list[tuple[float, float]]]]
STEP_S = 5  # query_range resolution: the scrape interval


def grafana_expr(expr: str, namespace: str, job: str, step_s: int = STEP_S) -> str:
    """`expr` as Grafana sends it for one selected job: the dashboard's variables replaced by
    regexes of the chosen values, `$__interval` by the step, and `$__rate_interval` by
    Grafana's rule, max($__interval + scrape interval, 4 x scrape interval)."""
    scrape_s = dashboard.parse_duration(prometheus.SCRAPE_INTERVAL)
    rate_s = int(max(step_s + scrape_s, 4 * scrape_s))
    return (expr.replace("$__rate_interval", f"{rate_s}s").replace("$__interval", f"{step_s}s")
            .replace("$namespace", namespace).replace("$job", job))


def query_range(kubectl: Callable, expr: str, start: float, end: float, step_s: int = STEP_S) -> Series:
    """A range query's result: each series' labels and its (t, value) points."""
    params = urllib.parse.urlencode({"query": expr, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": step_s})
    out = json.loads(kubectl("get", "--raw", f"{prometheus.QUERY_PATH}/api/v1/query_range?{params}",
                             timeout_s=30).stdout)
    if out.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {out}")
    return [(r["metric"], [(float(t), float(v)) for t, v in r["values"]]) for r in out["data"]["result"]]


def series_name(q: dashboard.Query, labels: dict[str, str]) -> str:
    """A series' name within its panel for one job: the query's name and its own labels
    (Grafana's legend without the job, which is selected)."""
    return " ".join(([q.name] if q.name else []) + [labels.get(label, "") for label in q.by]) or "value"


def panel_series(kubectl: Callable, namespace: str, job: str, start: float,
                 end: float) -> dict[str, list[tuple[str, list[tuple[float, float]]]]]:
    """Every panel's series over [start, end]: (name, points), its queries' results together."""
    return {panel.title: [(series_name(q, labels), points) for q in panel.queries
                          for labels, points in query_range(kubectl, grafana_expr(dashboard.promql(q), namespace, job),
                                                            start, end)]
            for panel in dashboard.PANELS}


def fired(kubectl: Callable, namespace: str, start: float, end: float) -> set[str]:
    """The alerts that were firing for the namespace's jobs at some point in [start, end]."""
    expr = f'max by (alertname) (ALERTS{{alertstate="firing", namespace="{namespace}"}})'
    return {labels["alertname"] for labels, points in query_range(kubectl, expr, start, end) if points}
