"""A TrainingJob on real kubelets: it trains in containers, survives a SIGKILLed worker
process (restarted in place by the launcher) and a deleted pod (its replica replaced by the
operator, on the other node), and finishes; status, Events, metrics and the checkpoint in
S3 show it, and so does the test environment's Prometheus (every dashboard panel has data,
the restart-loop alert fires); nothing it started is left running.

The scenario is hack/e2e_demo.py's (what `make e2e-demo` runs); the operator is installed
with the chart by `helm install`, and the job is examples/trainingjob-cpu.yaml with the test
image (the host's venv, mounted read-only: docs/testenv.md) in place of the published one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from e2e_demo import BUILT, EXAMPLE, OPERATOR_NAMESPACE, Scenario, use_test_image, with_trainer_image
from kube_helpers import wait_for
from transom.checkpoint import layout
from transom_operator import dashboard, reasons

pytestmark = [pytest.mark.slow, pytest.mark.real_nodes, pytest.mark.timeout(900)]


def _transom_processes() -> list[str]:
    """Host processes that run a Transom component or the example's training script."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            argv = cmdline.read_bytes().split(b"\0")
        except OSError:
            continue
        text = b" ".join(argv).decode(errors="replace")
        if "train_tiny_gpt.py" in text or "transom coordinator" in text or "transom-operator" in text:
            found.append(text)
    return found


def test_example_manifest_is_applied_unchanged_but_for_the_image():
    original = yaml.safe_load(EXAMPLE.read_text())
    patched = use_test_image(original)
    pod, orig_pod = patched["spec"]["template"]["spec"], original["spec"]["template"]["spec"]
    # Only the image, and the read-only mounts that make up the test image, differ.
    assert {k: v for k, v in patched.items() if k != "spec"} == {k: v for k, v in original.items() if k != "spec"}
    assert {k: v for k, v in patched["spec"].items() if k != "template"} == \
        {k: v for k, v in original["spec"].items() if k != "template"}
    for c, oc in zip(pod["containers"], orig_pod["containers"]):
        changed = ("image", "imagePullPolicy", "volumeMounts")
        assert {k: v for k, v in c.items() if k not in changed} == {k: v for k, v in oc.items() if k not in changed}
        added = c["volumeMounts"][len(oc.get("volumeMounts") or []):]
        assert c["volumeMounts"][:len(oc.get("volumeMounts") or [])] == (oc.get("volumeMounts") or [])
        assert added and all(m["readOnly"] for m in added)  # the test image: read-only host mounts
    assert {k: v for k, v in pod.items() if k not in ("containers", "volumes")} == \
        {k: v for k, v in orig_pod.items() if k not in ("containers", "volumes")}


def test_with_the_built_trainer_image_the_example_is_applied_unchanged_but_for_the_pull_policy():
    original = yaml.safe_load(EXAMPLE.read_text())
    built = with_trainer_image(original, BUILT)
    [container] = built["spec"]["template"]["spec"]["containers"]
    assert container.pop("imagePullPolicy") == "Never"  # imported into the nodes, never pulled
    assert built == original
    with pytest.raises(ValueError, match="trainer image 'docker'"):
        with_trainer_image(original, "docker")


def _metrics_and_prometheus_show_it(scenario: Scenario, seen, panels: Path, steps: int) -> None:
    # Metrics as Prometheus would scrape them, through the Services (the operator counts
    # the job Succeeded once its pass after the status write ends: a moment later).
    operator = wait_for(lambda: (m := scenario.scrape("operator"))['transom_operator_jobs{state="Succeeded"}'] == 1
                        and m, 30, "the operator's jobs gauge showing the job Succeeded")
    assert isinstance(operator, dict)
    assert operator['transom_operator_replica_failures_total{reason="PodDeleted"}'] == 1
    assert operator["transom_operator_replacements_total"] == 1
    assert operator["transom_operator_replacement_seconds_count"] == 1
    # The test environment's Prometheus, configured from the chart's ServiceMonitors, had
    # data for every panel of the dashboard but the batch shares (no Rebalance here), and
    # the chart's restart-loop alert fired (rendered at two failures: the kill, the delete).
    titles = [p.title for p in dashboard.PANELS]
    summary = seen.summary()
    assert seen.panels_with_data == [t for t in titles if t != "Batch share by replica"], seen.panels_with_data
    assert summary["prometheus_panels"] == len(titles) == summary["prometheus_panels_with_data"] + 1
    assert "TransomReplicaRestartLoop" in seen.alerts_fired, seen.alerts_fired
    assert set(json.loads(panels.read_text())["panels"]) == set(titles)  # what the docs picture is drawn from
    coordinator = scenario.scrape("coordinator")
    assert coordinator["transom_coordinator_step"] == steps
    assert coordinator['transom_coordinator_replica_failures_total{reason="reported"}'] >= 1  # the kill
    assert coordinator["transom_coordinator_last_checkpoint_step"] == steps
    assert 0 < coordinator["transom_coordinator_checkpoint_stall_seconds"] < 5


def test_job_on_real_nodes_survives_a_killed_worker_and_a_deleted_pod(control_plane, kube, namespace, tmp_path):
    if len(control_plane.real_nodes) < 2:
        pytest.fail("this test needs the test environment's real nodes: `hack/testenv.sh down`, then let the "
                    "tests start it (or `hack/testenv.sh up --real-nodes 2`)", pytrace=False)
    panels = tmp_path / "panels.json"
    scenario = Scenario(control_plane, namespace, log=lambda line: print(line, flush=True),
                        kubectl=kube.kubectl, helm=kube.helm, panels_out=panels)
    try:
        seen = scenario.run()
        summary = seen.summary()
        print(json.dumps(summary))
        steps = int(scenario.manifest["spec"]["template"]["spec"]["containers"][0]["command"][-1])

        # Trained to its step count with falling loss, and Succeeded.
        assert summary["succeeded"], seen.status
        assert summary["steps"] == steps
        assert len(seen.losses) >= 5 and seen.losses[-1] < 0.6 * seen.losses[0], seen.losses
        assert summary["container_runtime"].startswith("containerd://")
        # The operator and the coordinator ran the operator image built from its Dockerfile.
        assert summary["pods_run_the_built_images"], (summary["pod_image_ids"], summary["built_image_ids"])

        # The killed worker came back in place: same pod, same generation, no replacement.
        assert summary["in_place_restarts"] >= 1
        assert seen.killed_pod_uid[0] == seen.killed_pod_uid[1]
        # The deleted pod's replica was replaced once, on the other node; nothing else was.
        assert summary["replica_replacements"] == 1, (seen.status.get("replicas"), seen.events)
        assert seen.replacement_node != seen.deleted_pod_node, (seen.deleted_pod_node, seen.replacement_node)
        replicas = {r["id"]: r for r in seen.status["replicas"]}
        assert (replicas[0]["generation"], replicas[1]["generation"], replicas[2]["generation"]) == (0, 1, 0)
        assert replicas[1]["lastFailure"]["reason"] == reasons.POD_DELETED
        assert seen.untouched_uids[0] == seen.untouched_uids[1]  # the healthy replica never restarted
        assert {reasons.EVENT_REPLICA_FAILED, reasons.EVENT_REPLICA_REPLACED, reasons.EVENT_JOB_SUCCEEDED} \
            <= set(seen.events), seen.events

        # Checkpoints: the last one in status, and in S3 with its manifest.
        last = summary["last_checkpoint_step"]
        assert last == steps
        manifest = f"{layout.step_dir(last)}/{layout.MANIFEST}"
        assert any(k.endswith(manifest) for k in seen.checkpoint_keys), seen.checkpoint_keys[:20]

        _metrics_and_prometheus_show_it(scenario, seen, panels, steps)
    finally:
        kube.kubectl("delete", "tj", "--all", "-n", namespace, "--timeout=60s", check=False, timeout_s=70)
        kube.helm("uninstall", "transom", "-n", OPERATOR_NAMESPACE, "--wait", "--timeout=90s", check=False,
                  timeout_s=100)
    # Nothing Transom started is left running: pods gone, processes gone.
    wait_for(lambda: not json.loads(kube.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"],
             90, "the job's pods deleted")
    wait_for(lambda: not _transom_processes(), 60, f"no Transom process left on the host: {_transom_processes()}")
