"""The TrainingJob CRD in a real API server: bad specs are refused with clear messages.

The CRD generated from the pydantic models (crds/) is applied to the test control plane;
every manifest of tests/e2e/invalid_specs.py must be refused by the API server's own
schema or CEL validation with the message the table names, a valid one accepted, and the
immutable fields refused on update.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from invalid_specs import INVALID_SPECS, INVALID_UPDATES, VALID_MANIFEST

ROOT = Path(__file__).resolve().parents[2]
CRD = ROOT / "crds" / "trainingjobs.transom.io.yaml"


@pytest.fixture(scope="session")
def trainingjob_crd(kubectl):
    kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))
    kubectl("wait", "--for=condition=Established", "crd/trainingjobs.transom.io", "--timeout=60s", timeout_s=90)
    # Discovery of a new kind can lag the Established condition by a moment.
    for _ in range(50):
        if kubectl("get", "tj", "-A", check=False).returncode == 0:
            break
    return CRD


def _create(kubectl, namespace: str, manifest: dict):
    body = copy.deepcopy(manifest)
    body["metadata"]["namespace"] = namespace
    return kubectl("create", "-f", "-", input=json.dumps(body), check=False)


def test_valid_manifest_is_accepted_with_defaults_and_printer_columns(kubectl, namespace, trainingjob_crd):
    created = _create(kubectl, namespace, VALID_MANIFEST)
    assert created.returncode == 0, created.stderr
    name = VALID_MANIFEST["metadata"]["name"]
    stored = json.loads(kubectl("get", "tj", name, "-n", namespace, "-o", "json").stdout)
    ft = stored["spec"]["faultTolerance"]
    assert ft["nodeExclusionPolicy"] == "Taint" and ft["collectiveTimeoutSeconds"] > 0  # given, and defaulted
    header = kubectl("get", "tj", "-n", namespace).stdout.splitlines()[0].split()
    for column in ("STATE", "HEALTHY", "STEP", "CHECKPOINT", "RESTARTS", "AGE"):
        assert column in header
    explain = kubectl("explain", "trainingjob.spec.minReplicas").stdout
    assert "DESCRIPTION" in explain and len(explain.split("DESCRIPTION", 1)[1].strip()) > 20


@pytest.mark.parametrize("case", INVALID_SPECS, ids=[c.name for c in INVALID_SPECS])
def test_invalid_spec_is_rejected_by_the_api_server(kubectl, namespace, trainingjob_crd, case):
    result = _create(kubectl, namespace, case.manifest)
    assert result.returncode != 0, f"{case.name} was accepted"
    assert case.error in result.stderr, result.stderr


@pytest.mark.parametrize("case", INVALID_UPDATES, ids=[c.name for c in INVALID_UPDATES])
def test_immutable_fields_are_refused_on_update(kubectl, namespace, trainingjob_crd, case):
    assert _create(kubectl, namespace, VALID_MANIFEST).returncode == 0
    name = VALID_MANIFEST["metadata"]["name"]
    result = kubectl("patch", "tj", name, "-n", namespace, "--type=merge", "-p", json.dumps(case.changes), check=False)
    assert result.returncode != 0, f"{case.name} was accepted"
    assert case.error in result.stderr, result.stderr
