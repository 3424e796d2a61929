"""A TrainingJob on real kubelets: it trains in containers, survives a SIGKILLed worker
process (restarted in place by the launcher) and a deleted pod (its replica replaced by the
operator, on the other node), and finishes; status, Events, metrics and the checkpoint in
S3 show it, and nothing it started is left running.

The scenario is hack/e2e_demo.py's (what `make e2e-demo` runs); the operator is installed
with the chart by `helm install`, and the job is examples/trainingjob-cpu.yaml with the test
image (the host's venv, mounted read-only: docs/testenv.md) in place of the published one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from e2e_demo import EXAMPLE, OPERATOR_NAMESPACE, Scenario, use_test_image
from kube_helpers import wait_for
from transom.checkpoint import layout
from transom_operator import reasons

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _sources(recording: Path) -> set[str]:
    return {json.loads(line)["source"] for line in recording.read_text().splitlines() if line.strip()}


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


def test_job_on_real_nodes_survives_a_killed_worker_and_a_deleted_pod(control_plane, kube, namespace, tmp_path):
    if len(control_plane.real_nodes) < 2:
        pytest.fail("this test needs the test environment's real nodes: `hack/testenv.sh down`, then let the "
                    "tests start it (or `hack/testenv.sh up --real-nodes 2`)", pytrace=False)
    recording = tmp_path / "metrics.jsonl"
    scenario = Scenario(control_plane, namespace, log=lambda line: print(line, flush=True),
                        kubectl=kube.kubectl, helm=kube.helm, metrics_out=recording)
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

        # Metrics as Prometheus would scrape them, through the Services (the operator counts
        # the job Succeeded once its pass after the status write ends: a moment later).
        operator = wait_for(lambda: (m := scenario.scrape("operator"))['transom_operator_jobs{state="Succeeded"}'] == 1
                            and m, 30, "the operator's jobs gauge showing the job Succeeded")
        assert operator['transom_operator_replica_failures_total{reason="PodDeleted"}'] == 1
        assert operator["transom_operator_replacements_total"] == 1
        assert operator["transom_operator_replacement_seconds_count"] == 1
        assert _sources(recording) == {"operator", "coordinator"}  # what the dashboard's picture is drawn from
        coordinator = scenario.scrape("coordinator")
        assert coordinator["transom_coordinator_step"] == steps
        assert coordinator['transom_coordinator_replica_failures_total{reason="reported"}'] >= 1  # the kill
        assert coordinator["transom_coordinator_last_checkpoint_step"] == last
        assert 0 < coordinator["transom_coordinator_checkpoint_stall_seconds"] < 5
    finally:
        kube.kubectl("delete", "tj", "--all", "-n", namespace, "--timeout=60s", check=False, timeout_s=70)
        kube.helm("uninstall", "transom", "-n", OPERATOR_NAMESPACE, "--wait", "--timeout=90s", check=False,
                  timeout_s=100)
    # Nothing Transom started is left running: pods gone, processes gone.
    wait_for(lambda: not json.loads(kube.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"],
             90, "the job's pods deleted")
    wait_for(lambda: not _transom_processes(), 60, f"no Transom process left on the host: {_transom_processes()}")
