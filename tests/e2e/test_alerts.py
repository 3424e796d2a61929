"""The chart's alerts and the metrics they read, checked with Prometheus's own promtool:
`check rules` and `test rules` (tests/alerts/transom-rules.test.yaml: each alert fires on the
series it should and not on the others) on the PrometheusRule that `helm template` renders,
and `check metrics` on what the coordinator and the operator expose."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import requests
import yaml
from prometheus_client import generate_latest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))

from testenv import build  # noqa: E402
from testenv.tools import render_chart  # noqa: E402
from transom.coordinator.membership import Settings  # noqa: E402
from transom.coordinator.models import Identity, QuorumRequest, RegisterRequest  # noqa: E402
from transom.coordinator.thread import CoordinatorThread  # noqa: E402
from transom_operator import metrics as operator_metrics  # noqa: E402

RULE_TESTS = ROOT / "tests" / "alerts" / "transom-rules.test.yaml"


def _tool(name: str) -> Path:
    try:
        return build.lint_tool(name)
    except build.MissingTool as e:
        pytest.fail(str(e), pytrace=False)


def _promtool(*args: str, input: str | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([str(_tool("promtool")), *args], input=input, capture_output=True, text=True,
                          timeout=120, cwd=cwd)


def rules_of_chart(tmp_path: Path) -> Path:
    """The chart's PrometheusRule (default thresholds) as a Prometheus rules file."""
    try:
        chart = render_chart("--set", "metrics.prometheusRule.enabled=true")
    except build.MissingTool as e:
        pytest.fail(str(e), pytrace=False)
    [rule] = [d for d in chart if d["kind"] == "PrometheusRule"]
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


def test_the_charts_alerts_are_valid_and_fire_on_what_they_should(tmp_path):
    rules = rules_of_chart(tmp_path)
    checked = _promtool("check", "rules", str(rules))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    names = {r["alert"] for g in yaml.safe_load(rules.read_text())["groups"] for r in g["rules"]}
    assert names == {"TransomJobNotProgressing", "TransomGoodputLow", "TransomReplicaRestartLoop",
                     "TransomCheckpointStale", "TransomVerdict", "TransomOperatorDown"}
    tested = yaml.safe_load(RULE_TESTS.read_text())
    assert {t["alertname"] for case in tested["tests"] for t in case["alert_rule_test"]} == names  # each one tested
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    result = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode == 0 and "SUCCESS" in result.stdout, result.stdout + result.stderr


def test_a_broken_alert_fails_its_test(tmp_path):
    # The rule tests can fail: the stall alert with a window twice as long misses its time.
    rules = rules_of_chart(tmp_path)
    rules.write_text(rules.read_text().replace("[10m]", "[20m]").replace("offset 10m", "offset 20m"))
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    result = _promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path)
    assert result.returncode != 0 and "TransomJobNotProgressing" in result.stdout + result.stderr


def test_the_exposed_metrics_pass_promtool_check_metrics():
    coordinator = CoordinatorThread(Settings(job="lint", num_replicas=1), "t")
    url = coordinator.start()
    try:
        head = {"Authorization": "Bearer t"}
        me = Identity(replica_id=0, generation=0, attempt=0)
        requests.post(url + "/v1/register", headers=head, timeout=10, json=RegisterRequest(
            identity=me, store_addr="127.0.0.1:1", state_endpoints=["http://127.0.0.1:1/s"]).model_dump()
        ).raise_for_status()
        requests.post(url + "/v1/quorum", headers=head, timeout=10, json=QuorumRequest(
            identity=me, step=0, commit_quorum_id=-1, last_round=-1).model_dump()).raise_for_status()
        exposed = {"coordinator": requests.get(url + "/metrics", timeout=10).text}
    finally:
        coordinator.stop()
    exposed["operator"] = generate_latest(operator_metrics.REGISTRY).decode()
    for source, text in exposed.items():
        assert "transom_" in text
        result = _promtool("check", "metrics", input=text)
        assert result.returncode == 0 and not result.stdout.strip() and not result.stderr.strip(), \
            f"{source}: {result.stdout}{result.stderr}"
