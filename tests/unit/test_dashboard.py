"""The Grafana dashboard (transom_operator.dashboard), its chart ConfigMap and its PNG.

The committed JSON must equal the generator's output (as the CRDs must); every metric a
panel reads must be one the operator or the coordinator really exports (asked of their
registries, not parsed from source); the Python evaluator must compute what the PromQL
would on a small synthetic recording; `helm template` must ship the same JSON only when
enabled; and hack/render_dashboard.py must turn a recording into a PNG.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from membership_world import ident, make, qreq, register, round_all, started
from transom.coordinator.membership import Settings
from transom.coordinator.models import CheckpointReport
from transom.coordinator.server import CoordinatorServer
from transom_operator import dashboard, metrics

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "transom"
sys.path.insert(0, str(ROOT / "hack"))

from testenv import build  # noqa: E402


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
    m, d = started(2)
    now = [0.5]
    server = CoordinatorServer(Settings(job="t", num_replicas=2), token="t", clock=lambda: now[0])
    server.membership = m
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
    m, d = started(2)
    server = CoordinatorServer(Settings(job="t", num_replicas=2), token="t")
    server.membership = m

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
    m = make(3, min_replicas=2, startup_wait_s=0.0)  # replica 1 is not in: failed, or not started yet
    for r in (0, 2):
        register(m, r)
    server = CoordinatorServer(Settings(job="t", num_replicas=3), token="t")
    server.membership = m
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


# --- the evaluator ----------------------------------------------------------------------------------

def coordinator_scrape(t: float, step: int, healthy: int, reported: int, checkpoint_time: float | None = None) -> dict:
    lines = ["# TYPE transom_coordinator_step gauge", f"transom_coordinator_step {step}",
             "# TYPE transom_coordinator_healthy_replicas gauge", f"transom_coordinator_healthy_replicas {healthy}",
             "# TYPE transom_coordinator_replica_failures counter",
             f'transom_coordinator_replica_failures_total{{reason="reported"}} {reported}',
             'transom_coordinator_replica_failures_total{reason="heartbeat"} 0',
             "# TYPE transom_coordinator_goodput gauge",
             "# TYPE transom_coordinator_last_checkpoint_timestamp_seconds gauge"]
    if checkpoint_time is not None:
        lines.append(f"transom_coordinator_last_checkpoint_timestamp_seconds {checkpoint_time}")
    return {"t": t, "source": "coordinator", "text": "\n".join(lines) + "\n"}


def operator_scrape(t: float, buckets: dict[str, int]) -> dict:
    lines = ["# TYPE transom_operator_replacement_seconds histogram"]
    lines += [f'transom_operator_replacement_seconds_bucket{{le="{le}"}} {n}' for le, n in buckets.items()]
    lines += [f"transom_operator_replacement_seconds_count {buckets['+Inf']}",
              "transom_operator_replacement_seconds_sum 0"]
    return {"t": t, "source": "operator", "text": "\n".join(lines) + "\n"}


T0 = 1_700_000_000.0


def recording() -> list[dict]:
    """100 s of a job: 2 steps/s, a replica lost at 50 s, a checkpoint at 30 s; one replacement."""
    out = []
    for k in range(11):
        t = T0 + 10 * k
        out.append(coordinator_scrape(t, step=20 * k, healthy=3 if k < 5 else 2, reported=0 if k < 5 else 1,
                                      checkpoint_time=T0 + 30 if k >= 3 else None))
        done = k >= 6
        out.append(operator_scrape(t, {"1.0": 0, "5.0": int(done), "10.0": int(done), "+Inf": int(done)}))
    return out


def scrapes() -> list[dashboard.Scrape]:
    return dashboard.load_recording(json.dumps(r) for r in recording())


def test_gauge_and_age_are_the_scraped_values():
    s = scrapes()
    healthy = dashboard.evaluate(query_of("Healthy replicas"), s)
    assert healthy == {"value": [(T0 + 10 * k, 3.0 if k < 5 else 2.0) for k in range(11)]}
    age = dashboard.evaluate(query_of("Checkpoint age"), s)["value"]
    assert age[0] == (T0 + 30, 0.0) and age[-1] == (T0 + 100, 70.0)
    assert dashboard.evaluate(query_of("Goodput"), s) == {}  # no sample: "no data"


def test_step_rate_and_failures_over_the_window():
    s = scrapes()
    assert dashboard.default_rate_window([x for x in s if x.source == "coordinator"]) == 40.0
    rate = dashboard.evaluate(query_of("Step rate (steps/s)"), s)["value"]
    assert rate[0][0] == T0 + 10 and all(v == pytest.approx(2.0) for _, v in rate)
    failures = dict(dashboard.evaluate(query_of("Replica failures by reason"), s, rate_window_s=25.0))
    assert set(failures) == {"declared reported", "declared heartbeat"}
    declared = dict(failures["declared reported"])
    # The window (25 s, 50 s] holds the points at 30, 40 and 50 s: 0, 0, 1. PromQL would
    # extrapolate 5 s towards the window's start, but not below the counter's zero.
    assert declared[T0 + 50] == pytest.approx(1.0) and declared[T0 + 40] == 0
    assert declared[T0 + 80] == 0
    # The operator never exposed its labelled counter: no series, not a zero.
    assert "replaced" not in " ".join(failures)


def test_a_counter_reset_counts_from_zero():
    points = [(0.0, 5.0), (10.0, 7.0), (20.0, 1.0), (30.0, 4.0)]
    assert dashboard._increase(points, 0.0, 30.0) == pytest.approx(2 + 1 + 3)


def test_increase_extrapolates_like_promql():
    points = [(10.0, 10.0), (20.0, 20.0), (30.0, 30.0)]
    # 5 s short of both edges (less than 1.1 intervals): extrapolated over the 30 s window.
    assert dashboard._increase(points, 5.0, 35.0) == pytest.approx(20 * 30 / 20)
    # Far from the start: back to the counter's zero (10 s) when that is near enough...
    assert dashboard._increase(points, -100.0, 30.0) == pytest.approx(20 * 30 / 20)
    assert dashboard._increase([(10.0, 1.0), (20.0, 3.0)], 0.0, 20.0) == pytest.approx(2 * 15 / 10)
    # ...else half an interval.
    far = [(10.0, 100.0), (20.0, 110.0), (30.0, 120.0)]
    assert dashboard._increase(far, -100.0, 30.0) == pytest.approx(20 * 25 / 20)


def test_replacement_quantiles_interpolate_within_the_bucket():
    s = scrapes()
    p50 = dashboard.evaluate(query_of("Recovery: replica replacement time"), s)["p50"]
    # No replacement before 60 s (NaN, left out); then the one observation lies in (1, 5].
    assert p50[0] == (T0 + 60, pytest.approx(3.0)) and len(p50) == 5
    p90 = dashboard.evaluate(query_of("Recovery: replica replacement time", 1), s)["p90"]
    assert p90[0][1] == pytest.approx(1 + 4 * 0.9)
    assert dashboard.bucket_quantile(0.5, [(1.0, 2), (math.inf, 4)]) == 1.0  # in +Inf: the highest bound
    assert math.isnan(dashboard.bucket_quantile(0.5, [(1.0, 0), (math.inf, 0)]))


def test_a_recording_names_its_source():
    with pytest.raises(ValueError, match="operator or coordinator"):
        dashboard.parse_scrape({"t": 0, "source": "worker", "text": ""})


# --- the chart ------------------------------------------------------------------------------------

def helm_template(*args: str) -> list[dict]:
    helm = build.bin_dir() / "helm"
    if not helm.exists():
        pytest.fail(f"no helm at {helm}: run `hack/testenv.sh build`", pytrace=False)
    out = subprocess.run([str(helm), "template", "transom", str(CHART), "-n", "monitoring", *args],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


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

def test_render_writes_a_png_with_every_key_panel(tmp_path):
    renderer = _load_renderer()
    path = tmp_path / "scrapes.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in recording()))
    out = tmp_path / "dashboard.png"
    assert renderer.main([str(path), str(out), "--title", "synthetic"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(renderer.key_panels()) == 9


def test_the_legend_names_only_the_series_that_left_zero():
    import matplotlib.pyplot as plt

    renderer = _load_renderer()
    (panel,) = [p for p in renderer.key_panels() if p.title == "Replica failures by reason"]
    s = scrapes()
    fig, ax = plt.subplots()
    try:
        renderer._draw(ax, panel, s, (s[0].t, s[-1].t), 25.0)
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["declared reported"]
        assert len(ax.get_lines()) == 2  # the heartbeat series is still drawn, faint
    finally:
        plt.close(fig)


def test_render_of_an_empty_recording_says_no_data(tmp_path):
    renderer = _load_renderer()
    out = tmp_path / "empty.png"
    renderer.render([], out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
