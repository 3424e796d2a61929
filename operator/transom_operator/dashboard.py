"""The Grafana dashboard of Transom, generated from panel definitions held as data.

    python -m transom_operator.dashboard           write charts/transom/dashboards/transom.json
    python -m transom_operator.dashboard --check   exit 1 with a diff if the committed file differs

Each panel's queries are small `Query` values, not PromQL strings, so that the PromQL the
dashboard runs (`promql`) is built one way for every panel, and the tests can reason about
what each panel reads. The picture in the docs is drawn from a real Prometheus's answers to
these same queries over an e2e run (hack/prom_panels.py, hack/render_dashboard.py).

Coordinator series carry no job label of their own: the target labels Prometheus adds
(`namespace`, and `service` = `<job>-coordinator` when a ServiceMonitor scrapes the
coordinator Services) tell the jobs apart, so the dashboard's `namespace` and `job`
variables select on those.
"""

from __future__ import annotations

import argparse
import difflib
import json
import re
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[2]
OUTPUT = Path("charts") / "transom" / "dashboards" / "transom.json"
COORDINATOR_PREFIX = "transom_coordinator_"
# Target labels of a coordinator series (see the module docstring) and the variables on them.
TARGET_LABELS = ("namespace", "service")
SELECTOR = 'namespace=~"$namespace", service=~"($job)-coordinator"'
RATE_INTERVAL = "$__rate_interval"
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}

Kind = Literal["gauge", "rate", "increase", "deriv", "quantile", "age"]
Source = Literal["operator", "coordinator"]


def parse_duration(text: str) -> float:
    """Seconds of a Prometheus duration like "90s", "10m", "1h30m"."""
    parts = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m)?(?:(\d+)s)?", text)
    if not text or parts is None:
        raise ValueError(f"a duration must look like 30s, 10m or 1h, got {text!r}")
    h, m, s = (int(p or 0) for p in parts.groups())
    return float(h * 3600 + m * 60 + s)


@dataclass(frozen=True)
class Query:
    """One series family of a panel.

    gauge     agg by (labels) (metric)
    rate      agg by (labels) (rate(metric[window]))       per series first, then aggregated
    increase  agg by (labels) (increase(metric[window]))
    deriv     agg by (labels) (deriv(metric[window]))      the per-second slope of a gauge
    quantile  histogram_quantile(q, sum by (labels, le) (rate(metric_bucket[window])))
    age       time() - agg by (labels) (metric)            metric: a unix timestamp
    """

    kind: Kind
    metric: str  # the sample name as exposed (`_total` on counters); a histogram's base name
    by: tuple[str, ...] = ()  # labels of the metric itself; coordinator ones add TARGET_LABELS
    agg: Literal["sum", "max"] = "sum"
    window: str = RATE_INTERVAL  # a Prometheus duration ("10m") or Grafana's $__rate_interval
    quantile: float | None = None
    name: str = ""  # names the series in legends: "p90", "declared"

    def __post_init__(self) -> None:
        assert (self.kind == "quantile") == (self.quantile is not None), self
        assert self.window == RATE_INTERVAL or parse_duration(self.window) > 0, self

    @property
    def source(self) -> Source:
        return "coordinator" if self.metric.startswith(COORDINATOR_PREFIX) else "operator"

    @property
    def group_by(self) -> tuple[str, ...]:
        return (TARGET_LABELS if self.source == "coordinator" else ()) + self.by

    @property
    def sample_names(self) -> tuple[str, ...]:
        """The exposed samples this query reads."""
        return (f"{self.metric}_bucket",) if self.kind == "quantile" else (self.metric,)


@dataclass(frozen=True)
class Panel:
    title: str
    description: str
    unit: str  # a Grafana unit id
    queries: tuple[Query, ...]
    style: Literal["timeseries", "stat"] = "timeseries"
    min: float | None = None
    max: float | None = None


# The stat row at the top, then the key panels two per row (hack/render_dashboard.py draws
# the timeseries ones).
PANELS: tuple[Panel, ...] = (
    Panel("Step", "Highest committed step reported by any replica.", "none",
          (Query("gauge", "transom_coordinator_step", agg="max"),), style="stat"),
    Panel("Last checkpoint", "Step of the newest committed checkpoint.", "none",
          (Query("gauge", "transom_coordinator_last_checkpoint_step", agg="max"),), style="stat"),
    Panel("Paused", "1 while fewer than minReplicas replicas are ready.", "none",
          (Query("gauge", "transom_coordinator_paused", agg="max"),), style="stat"),
    Panel("Jobs by state", "TrainingJobs by state, as the leading operator last reconciled them.", "none",
          (Query("gauge", "transom_operator_jobs", by=("state",)),), style="stat"),
    Panel("Goodput", "Fraction of the job's time spent on steps that were kept (the coordinator's "
          "goodput clock, as status.training.goodput).", "percentunit",
          (Query("gauge", "transom_coordinator_goodput", agg="max"),), min=0, max=1),
    Panel("Step rate (steps/s)", "Committed optimizer steps per second: the slope of the job's step.", "short",
          (Query("deriv", "transom_coordinator_step", agg="max"),), min=0),
    Panel("Healthy replicas", "Replica incarnations the coordinator currently counts as healthy.", "short",
          (Query("gauge", "transom_coordinator_healthy_replicas", agg="max"),), min=0),
    Panel("Replica failures by reason", "Incarnations the coordinator declared failed, and failures the "
          "operator replaced, per reason, over the rate interval.", "short",
          (Query("increase", "transom_coordinator_replica_failures_total", by=("reason",), name="declared"),
           Query("increase", "transom_operator_replica_failures_total", by=("reason",), name="replaced")), min=0),
    Panel("Recovery: replica replacement time", "From a replica failure detected to all of its replacement "
          "pods Running (operator histogram), median and 90th percentile over 10 minutes.", "s",
          (Query("quantile", "transom_operator_replacement_seconds", window="10m", quantile=0.5, name="p50"),
           Query("quantile", "transom_operator_replacement_seconds", window="10m", quantile=0.9, name="p90")),
          min=0),
    Panel("Checkpoint age", "Seconds since the newest committed checkpoint was reported: the work a "
          "restart from storage would lose.", "s",
          (Query("age", "transom_coordinator_last_checkpoint_timestamp_seconds", agg="max"),), min=0),
    Panel("Checkpoint stall", "How long the training loop waited for the newest checkpoint's memory "
          "snapshot (the rest of the save runs in the background).", "s",
          (Query("gauge", "transom_coordinator_checkpoint_stall_seconds", agg="max"),), min=0),
    Panel("Anomaly verdicts by kind", "Anomalies the coordinator's detectors found (spec.detection: slow, "
          "hang, nan, loss_spike, sdc), over the rate interval.", "short",
          (Query("increase", "transom_coordinator_verdicts_total", by=("kind",)),), min=0),
    Panel("Batch share by replica", "Each replica's share of the global batch while a slow replica is "
          "rebalanced (spec.detection.slowAction Rebalance; 1 is the nominal share; no data otherwise).", "short",
          (Query("gauge", "transom_coordinator_batch_share", by=("replica",), agg="max"),), min=0),
)


# --- PromQL ------------------------------------------------------------------------------

def _by(labels: tuple[str, ...]) -> str:
    return f" by ({', '.join(labels)})" if labels else ""


def promql(q: Query) -> str:
    """The PromQL expression of one query."""
    selector = f"{{{SELECTOR}}}" if q.source == "coordinator" else ""
    series = f"{q.sample_names[0]}{selector}"
    if q.kind == "quantile":
        return f"histogram_quantile({q.quantile}, sum{_by(q.group_by + ('le',))} (rate({series}[{q.window}])))"
    if q.kind in ("rate", "increase", "deriv"):
        series = f"{q.kind}({series}[{q.window}])"
    expr = f"{q.agg}{_by(q.group_by)} ({series})"
    return f"time() - {expr}" if q.kind == "age" else expr


def legend(q: Query) -> str:
    """Grafana's legendFormat: the job (coordinator series), the query's name, its labels."""
    parts = (["{{namespace}}/{{service}}"] if q.source == "coordinator" else []) + ([q.name] if q.name else [])
    return " ".join(parts + [f"{{{{{label}}}}}" for label in q.by]) or "value"


# --- the dashboard ------------------------------------------------------------------------

def _variables() -> list[dict]:
    def query_var(name: str, label: str, query: str, regex: str = "") -> dict:
        return {"name": name, "label": label, "type": "query", "datasource": DATASOURCE,
                "query": {"query": query, "refId": name}, "definition": query, "regex": regex,
                "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "allValue": ".*",
                "current": {}, "options": [], "hide": 0}

    return [
        {"name": "datasource", "label": "Data source", "type": "datasource", "query": "prometheus",
         "current": {}, "options": [], "refresh": 1, "regex": "", "hide": 0},
        query_var("namespace", "Namespace", "label_values(transom_coordinator_step, namespace)"),
        # The coordinator's Service is `<job>-coordinator`: the variable lists job names.
        query_var("job", "TrainingJob", 'label_values(transom_coordinator_step{namespace=~"$namespace"}, service)',
                  regex="/^(.+)-coordinator$/"),
    ]


def _panel_json(panel: Panel, panel_id: int, grid: dict) -> dict:
    defaults: dict = {"unit": panel.unit}
    defaults.update({k: v for k, v in (("min", panel.min), ("max", panel.max)) if v is not None})
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": promql(q),
                "legendFormat": legend(q), "range": True} for i, q in enumerate(panel.queries)]
    if panel.style == "stat":
        options = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                   "colorMode": "value", "graphMode": "area", "textMode": "auto", "justifyMode": "auto",
                   "orientation": "auto"}
    else:
        options = {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                   "tooltip": {"mode": "multi", "sort": "none"}}
    return {"id": panel_id, "type": panel.style, "title": panel.title, "description": panel.description,
            "datasource": DATASOURCE, "gridPos": grid, "fieldConfig": {"defaults": defaults, "overrides": []},
            "options": options, "targets": targets}


def _layout(panels: Iterable[Panel]) -> list[dict]:
    """Stats share the first row (height 4); timeseries follow two per row (height 8)."""
    panels = list(panels)
    stats = [p for p in panels if p.style == "stat"]
    grids = []
    for p in panels:
        if p.style == "stat":
            i = stats.index(p)
            grids.append({"h": 4, "w": 24 // len(stats), "x": i * (24 // len(stats)), "y": 0})
        else:
            i = len(grids) - len(stats)
            grids.append({"h": 8, "w": 12, "x": (i % 2) * 12, "y": (4 if stats else 0) + (i // 2) * 8})
    return grids


def dashboard_json() -> dict:
    """The dashboard as Grafana's JSON model (deterministic: no ids from the environment)."""
    grids = _layout(PANELS)
    return {
        "uid": "transom", "title": "Transom", "schemaVersion": 39, "version": 1,
        "description": "Fault-tolerant training jobs: goodput, progress, failures and recovery "
                       "(generated by transom_operator.dashboard; do not edit).",
        "tags": ["transom"], "editable": True, "graphTooltip": 1, "timezone": "browser",
        "time": {"from": "now-6h", "to": "now"}, "refresh": "30s",
        "annotations": {"list": []}, "links": [],
        "templating": {"list": _variables()},
        "panels": [_panel_json(p, i + 1, g) for i, (p, g) in enumerate(zip(PANELS, grids))],
    }


def render() -> str:
    return json.dumps(dashboard_json(), indent=2, sort_keys=True) + "\n"


# --- command line -----------------------------------------------------------------------------------

def check(root: Path = ROOT) -> list[str]:
    """A unified diff of the committed dashboard against the generated one (empty: equal)."""
    path = root / OUTPUT
    committed = path.read_text() if path.exists() else ""
    return list(difflib.unified_diff(committed.splitlines(keepends=True), render().splitlines(keepends=True),
                                     f"{OUTPUT} (committed)", f"{OUTPUT} (generated)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m transom_operator.dashboard", description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 with a diff if the committed file is stale")
    parser.add_argument("--root", type=Path, default=ROOT, help="the checkout to write into or check")
    args = parser.parse_args(argv)
    if args.check:
        diff = check(args.root)
        sys.stdout.writelines(diff)
        return 1 if diff else 0
    path = args.root / OUTPUT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
