"""The Grafana dashboard (transom_operator.dashboard), its chart ConfigMap and its PNG.

The committed JSON must equal the generator's output (as the CRDs must); every metric a
panel reads must be one the operator or the coordinator really exports (asked of their
registries, not parsed from source); Grafana's variables and macros are substituted as
Grafana does for the real Prometheus of the e2e run (hack/prom_panels.py); `helm template`
must ship the same JSON only when enabled; and hack/render_dashboard.py must turn a run's
panels into a PNG.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from membership_world import begin, ident, qreq, register, round_all
from transom.coordinator.membership import Settings
from transom.coordinator.models import CheckpointReport
from transom.coordinator.server import CoordinatorServer
from transom_operator import dashboard, metrics

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))

import prom_panels  # noqa: E402
from testenv import build  # noqa: E402
from testenv.tools import render_chart  # noqa: E402


def _load_renderer():
    spec = importlib.util.spec_from_file_location("render_dashboard", ROOT / "hack" / "render_dashboard.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def queries() -> list[dashboard.Query]:
    return [q for p in dashboard.PANELS for q in p.queries]


def query_of(title: str, index: int = 0) -> dashboard.Query:
    (panel,) = [p for p in dashboard.PANELS if p.title == title]
    return panel.queries[index]


# --- the generated file -----------------------------------------------------------------------

def test_committed_dashboard_equals_generated():
    diff = dashboard.check()
    assert not diff, "stale dashboard, run `make generate`:\n" + "".join(diff)


def test_check_cli_fails_on_a_stale_file_and_write_fixes_it(tmp_path, capsys):
    assert dashboard.main(["--check", "--root", str(tmp_path)]) == 1
    assert dashboard.main(["--root", str(tmp_path)]) == 0
    assert dashboard.main(["--check", "--root", str(tmp_path)]) == 0
    path = tmp_path / dashboard.OUTPUT
    path.write_text(path.read_text().replace('"Goodput"', '"Badput"'))
    capsys.readouterr()
    assert dashboard.main(["--check", "--root", str(tmp_path)]) == 1
    assert '-      "title": "Badput"' in capsys.readouterr().out


def test_dashboard_identity_and_layout():
    d = dashboard.dashboard_json()
    assert dashboard.render() == dashboard.render() and dashboard.render().endswith("}\n")
    assert (d["uid"], d["title"], d["schemaVersion"]) == ("transom", "Transom", 39)
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert list(variables) == ["datasource", "namespace", "job"]
    assert (variables["datasource"]["type"], variables["datasource"]["query"]) == ("datasource", "prometheus")
    assert "label_values(" in variables["job"]["definition"] and variables["job"]["regex"]
    cells = set()
    for panel in d["panels"]:
        g = panel["gridPos"]
        assert panel["type"] in ("timeseries", "stat") and panel["datasource"]["uid"] == "${datasource}"
        assert g["x"] + g["w"] <= 24 and panel["targets"]
        cell = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cell & cells, f"{panel['title']} overlaps another panel"
        cells |= cell
    assert len({p["id"] for p in d["panels"]}) == len(d["panels"])
    titles = {p["title"] for p in d["panels"] if p["type"] == "timeseries"}
    assert {"Goodput", "Step rate (steps/s)", "Healthy replicas", "Replica failures by reason",
            "Recovery: replica replacement time", "Checkpoint age", "Checkpoint stall", "Anomaly verdicts by kind",
            "Batch share by replica"} == titles


# --- the metrics the panels read exist ---------------------------------------------------------

def _sample_names(families) -> set[str]:
    """Names a family exposes, whether or not a labelled child exists yet."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    return {f.name + s for f in families for s in suffixes[f.type]}


def exported() -> dict[str, set[str]]:
    server = CoordinatorServer(Settings(job="t"), token="t")
    return {"operator": _sample_names(metrics.REGISTRY.collect()),
            "coordinator": _sample_names(server.lookups.registry.collect())}


def test_every_metric_a_panel_uses_is_exported():
    names = exported()
    for q in queries():
        for sample in q.sample_names:
            assert sample in names[q.source], f"{q.metric} is not exported by the {q.source}"


def test_coordinator_exports_goodput_and_checkpoint_once_known():
    now = [0.5]
    server = CoordinatorServer(Settings(job="t", num_replicas=2), token="t", clock=lambda: now[0])
    m = server.membership
    d = begin(m)
    # Known only after a step was committed and a checkpoint reported: no sample before.
    exposition = generate_latest(server.lookups.registry).decode()
    before = {f.name: f.samples for f in text_string_to_metric_families(exposition)}
    assert before["transom_coordinator_goodput"] == []
    assert before["transom_coordinator_last_checkpoint_timestamp_seconds"] == []
    assert before["transom_coordinator_checkpoint_stall_seconds"] == []
    round_all(m, [qreq(r, step=1, commit=d.quorum_id, last_round=d.round) for r in (0, 1)], 1.0)
    m.record_checkpoint(CheckpointReport(identity=ident(0), step=1, uri="file:///ckpt", stall_seconds=0.25),
                        1_700_000_000.0, 1.0)
    now[0] = 2.0
    after = {s.name: s.value for f in text_string_to_metric_families(generate_latest(server.lookups.registry).decode())
             for s in f.samples}
    assert after["transom_coordinator_goodput"] == 0.5  # 1 productive second of 2
    assert after["transom_coordinator_last_checkpoint_step"] == 1
    assert after["transom_coordinator_last_checkpoint_timestamp_seconds"] == 1_700_000_000.0
    assert after["transom_coordinator_checkpoint_stall_seconds"] == 0.25


def test_batch_shares_are_exported_per_replica_while_rebalanced():
    server = CoordinatorServer(Settings(job="t", num_replicas=2), token="t")
    m = server.membership
    d = begin(m)

    def shares():
        text = generate_latest(server.lookups.registry).decode()
        return {s.labels["replica"]: s.value for f in text_string_to_metric_families(text)
                for s in f.samples if s.name == "transom_coordinator_batch_share"}

    assert shares() == {}  # nominal: no sample
    m.shares.slow(1, 2.0)
    round_all(m, [qreq(r, step=1, commit=d.quorum_id, last_round=d.round).model_copy(update={"follows_shares": True})
                  for r in (0, 1)], 1.0)
    assert shares() == {"0": pytest.approx(4 / 3, abs=1e-3), "1": pytest.approx(2 / 3, abs=1e-3)}


def test_a_replica_outside_the_quorum_exports_no_batch_share():
    # Replica 1 is not in: failed, or not started yet.
    server = CoordinatorServer(Settings(job="t", num_replicas=3, min_replicas=2, startup_wait_s=0.0), token="t")
    m = server.membership
    for r in (0, 2):
        register(m, r)
    m.shares.slow(0, 2.0)
    round_all(m, [qreq(r).model_copy(update={"follows_shares": True}) for r in (0, 2)], 2.0)
    text = generate_latest(server.lookups.registry).decode()
    shares = {s.labels["replica"]: s.value for f in text_string_to_metric_families(text)
              for s in f.samples if s.name == "transom_coordinator_batch_share"}
    assert shares == {"0": pytest.approx(2 / 3, abs=1e-3), "2": pytest.approx(4 / 3, abs=1e-3)}


# --- PromQL ---------------------------------------------------------------------------------------

def test_promql_of_coordinator_panels_selects_the_job():
    sel = '{namespace=~"$namespace", service=~"($job)-coordinator"}'
    assert dashboard.promql(query_of("Goodput")) == f"max by (namespace, service) (transom_coordinator_goodput{sel})"
    assert dashboard.promql(query_of("Step rate (steps/s)")) == \
        f"max by (namespace, service) (deriv(transom_coordinator_step{sel}[$__rate_interval]))"
    assert dashboard.promql(query_of("Replica failures by reason")) == \
        "sum by (namespace, service, reason) " \
        f"(increase(transom_coordinator_replica_failures_total{sel}[$__rate_interval]))"
    assert dashboard.promql(query_of("Checkpoint age")) == \
        f"time() - max by (namespace, service) (transom_coordinator_last_checkpoint_timestamp_seconds{sel})"


def test_promql_of_operator_panels():
    assert dashboard.promql(query_of("Replica failures by reason", 1)) == \
        "sum by (reason) (increase(transom_operator_replica_failures_total[$__rate_interval]))"
    assert dashboard.promql(query_of("Recovery: replica replacement time", 1)) == \
        "histogram_quantile(0.9, sum by (le) (rate(transom_operator_replacement_seconds_bucket[10m])))"
    assert dashboard.legend(query_of("Replica failures by reason", 1)) == "replaced {{reason}}"


def test_durations():
    assert dashboard.parse_duration("10m") == 600 and dashboard.parse_duration("1h30s") == 3630
    for bad in ("", "10", "5d", "m"):
        with pytest.raises(ValueError, match="duration"):
            dashboard.parse_duration(bad)


# --- as Grafana sends it, and series names ----------------------------------------------------------

def test_grafana_variables_and_macros_are_substituted_as_grafana_does():
    expr = dashboard.promql(query_of("Replica failures by reason"))
    sent = prom_panels.grafana_expr(expr, "ml", "tiny", step_s=5)
    # $__rate_interval: max($__interval + scrape interval, 4 x scrape interval), scrape every 5 s.
    assert sent == 'sum by (namespace, service, reason) (increase(transom_coordinator_replica_failures_total' \
                   '{namespace=~"ml", service=~"(tiny)-coordinator"}[20s]))'
    assert "[65s]" in prom_panels.grafana_expr(expr, "ml", "tiny", step_s=60)  # a coarse step widens it
    assert "$" not in "".join(prom_panels.grafana_expr(dashboard.promql(q), "ml", "tiny") for q in queries())


def test_a_series_is_named_by_its_query_and_its_own_labels_not_the_job():
    replaced = query_of("Replica failures by reason", 1)
    assert prom_panels.series_name(replaced, {"namespace": "ml", "reason": "PodDeleted"}) == "replaced PodDeleted"
    assert prom_panels.series_name(query_of("Goodput"), {"namespace": "ml", "service": "t-coordinator"}) == "value"


# --- the chart ------------------------------------------------------------------------------------

def helm_template(*args: str) -> list[dict]:
    try:
        return render_chart(*args, namespace="monitoring")
    except build.MissingTool as e:
        pytest.fail(str(e), pytrace=False)


def dashboard_configmaps(docs: list[dict]) -> list[dict]:
    return [d for d in docs if d["kind"] == "ConfigMap" and "transom.json" in d.get("data", {})]


def test_chart_ships_the_dashboard_only_when_enabled():
    assert dashboard_configmaps(helm_template()) == []
    (cm,) = dashboard_configmaps(helm_template("--set", "grafanaDashboard.enabled=true"))
    assert json.loads(cm["data"]["transom.json"]) == dashboard.dashboard_json()
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring" and "annotations" not in cm["metadata"]


def test_chart_dashboard_label_folder_and_namespace_are_configurable():
    (cm,) = dashboard_configmaps(helm_template(
        "--set", "grafanaDashboard.enabled=true", "--set", "grafanaDashboard.labelKey=dashboards",
        "--set", "grafanaDashboard.labelValue=transom", "--set", "grafanaDashboard.folder=Training",
        "--set", "grafanaDashboard.namespace=grafana"))
    meta = cm["metadata"]
    assert meta["labels"]["dashboards"] == "transom" and "grafana_dashboard" not in meta["labels"]
    assert meta["annotations"] == {"grafana_folder": "Training"} and meta["namespace"] == "grafana"


# --- the PNG --------------------------------------------------------------------------------------

T0 = 1_700_000_000.0


def panels_file(tmp_path: Path) -> Path:
    """A run's panels as `make e2e-demo` writes them: 100 s, a failure at 50 s."""
    points = lambda f: [[T0 + 10 * k, f(k)] for k in range(11)]  # noqa: E731
    panels = {
        "Step rate (steps/s)": [["value", points(lambda k: 2.0)]],
        "Replica failures by reason": [["declared reported", points(lambda k: 1.0 if k in (5, 6) else 0.0)],
                                       ["declared heartbeat", points(lambda k: 0.0)]],
        "Recovery: replica replacement time": [["p50", points(lambda k: float("nan") if k < 6 else 4.5)]],
    }
    path = tmp_path / "panels.json"
    path.write_text(json.dumps({"title": "ml/tiny", "start": T0, "end": T0 + 100, "panels": panels}))
    return path


def test_render_writes_a_png_with_every_key_panel(tmp_path):
    renderer = _load_renderer()
    out = tmp_path / "dashboard.png"
    assert renderer.main([str(panels_file(tmp_path)), str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(renderer.key_panels()) == 9


def test_the_legend_names_only_the_series_that_left_zero(tmp_path):
    import matplotlib.pyplot as plt

    renderer = _load_renderer()
    (panel,) = [p for p in renderer.key_panels() if p.title == "Replica failures by reason"]
    series = json.loads(panels_file(tmp_path).read_text())["panels"]
    fig, ax = plt.subplots()
    try:
        renderer._draw(ax, panel, series[panel.title], (T0, T0 + 100))
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["declared reported"]
        assert len(ax.get_lines()) == 2  # the heartbeat series is still drawn, faint
    finally:
        plt.close(fig)


def test_render_of_a_run_without_data_says_no_data(tmp_path):
    import matplotlib.pyplot as plt

    renderer = _load_renderer()
    fig, ax = plt.subplots()
    try:
        renderer._draw(ax, renderer.key_panels()[0], [["p50", [[T0, float("nan")]]]], (T0, T0 + 100))
        assert [t.get_text() for t in ax.texts] == ["no data"]  # NaN points only: nothing to draw
    finally:
        plt.close(fig)
    out = tmp_path / "empty.png"
    renderer.render({}, (T0, T0 + 100), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
