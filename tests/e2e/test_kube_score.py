"""kube-score on what a cluster admin installs and what the operator creates: the chart
rendered with every optional part on, and the objects of each example TrainingJob
(hack/operator_objects.py). Every finding is fixed or waived in
charts/transom/kube-score-waivers.yaml with a reason; a waiver that no finding needs fails
too, so the file never claims more than is true."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "hack"))

import operator_objects  # noqa: E402
from testenv import build  # noqa: E402
from testenv.tools import render_chart  # noqa: E402

WAIVERS = ROOT / "charts" / "transom" / "kube-score-waivers.yaml"
OPTIONAL_PARTS = ("metrics.serviceMonitor.enabled=true", "metrics.prometheusRule.enabled=true",
                  "grafanaDashboard.enabled=true")


def _tool(name: str) -> Path:
    try:
        return build.lint_tool(name)
    except build.MissingTool as e:
        pytest.fail(str(e), pytrace=False)


def _rendered(tmp_path: Path) -> list[Path]:
    try:
        chart = render_chart(*[a for part in OPTIONAL_PARTS for a in ("--set", part)])
    except build.MissingTool as e:
        pytest.fail(str(e), pytrace=False)
    objects = [o for path in operator_objects.EXAMPLES for o in operator_objects.objects_of(yaml.safe_load(
        path.read_text()), namespace="ml")]
    (tmp_path / "chart.yaml").write_text(yaml.safe_dump_all(chart))
    (tmp_path / "operator.yaml").write_text(yaml.safe_dump_all(objects))
    return [tmp_path / "chart.yaml", tmp_path / "operator.yaml"]


def findings(files: list[Path]) -> list[tuple[str, str, str, str]]:
    """(check id, summary, kind, name) of every comment kube-score grades below OK."""
    proc = subprocess.run([str(_tool("kube-score")), "score", "--output-format", "json", *map(str, files)],
                          capture_output=True, text=True, timeout=120)
    if proc.returncode not in (0, 1):  # 1: it found something
        raise AssertionError(f"kube-score failed ({proc.returncode}): {proc.stderr}")
    out = []
    for obj in json.loads(proc.stdout):
        for result in obj["checks"]:
            if result["skipped"] or result["grade"] >= 10:
                continue
            for comment in result["comments"] or [{"summary": result["check"]["name"]}]:
                out.append((result["check"]["id"], comment["summary"], obj["type_meta"]["kind"], obj["object_name"]))
    return out


def _waives(waiver: dict, finding: tuple[str, str, str, str]) -> bool:
    check, summary, _kind, name = finding
    return waiver["check"] == check and waiver["summary"] == summary and re.search(waiver["names"], name) is not None


def test_every_kube_score_finding_is_fixed_or_waived_with_a_reason(tmp_path):
    waivers = yaml.safe_load(WAIVERS.read_text())
    assert all(w.get("why", "").strip() for w in waivers), "every waiver says why"
    found = findings(_rendered(tmp_path))
    # What is looked at: the chart's workloads and every kind of object the operator makes.
    unwaived = [f for f in found if not any(_waives(w, f) for w in waivers)]
    assert not unwaived, "kube-score findings neither fixed nor waived:\n" + "\n".join(map(str, unwaived))
    unused = [w["check"] + ": " + w["summary"] for w in waivers if not any(_waives(w, f) for f in found)]
    assert not unused, f"waivers that no finding needs any more: {unused}"


def test_kube_score_finds_what_the_waivers_do_not_cover(tmp_path):
    # The check is live: a worker pod with a writable root filesystem and identical probes is
    # caught (the examples' fixes are what keep those findings away).
    pod = operator_objects.objects_of(yaml.safe_load(operator_objects.EXAMPLES[0].read_text()))[-1]
    container = pod["spec"]["containers"][0]
    container["securityContext"]["readOnlyRootFilesystem"] = False
    container["readinessProbe"] = container["livenessProbe"] = {"httpGet": {"path": "/", "port": 8080}}
    (tmp_path / "pod.yaml").write_text(yaml.safe_dump(pod))
    ids = {f[0] for f in findings([tmp_path / "pod.yaml"])}
    assert {"container-security-context-readonlyrootfilesystem", "pod-probes-identical"} <= ids, ids
