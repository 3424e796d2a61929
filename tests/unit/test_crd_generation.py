"""The TrainingJob CRD: generated from the pydantic models, structural, bounded, documented.

The committed YAML must equal the generator's output (the CI diff check). The schema is
walked node by node for what the API server requires (structural) and what the house
requires (descriptions, bounds). The models accept the example manifest and reject the
invalid ones that tests/e2e/invalid_specs.py feeds to the real API server.
"""

from __future__ import annotations

import copy
import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel, ValidationError

from transom_operator import api, crdgen

ROOT = Path(__file__).resolve().parents[2]


def _load_invalid_specs():
    spec = importlib.util.spec_from_file_location("invalid_specs", ROOT / "tests" / "e2e" / "invalid_specs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cases = _load_invalid_specs()
SCHEMA = crdgen.openapi_schema()


def walk(node: dict[str, Any], path: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """Every schema node with its path (".spec.replicas", ".status.replicas[]")."""
    yield path, node
    for name, sub in node.get("properties", {}).items():
        yield from walk(sub, f"{path}.{name}")
    if "items" in node:
        yield from walk(node["items"], f"{path}[]")


def node_at(path: str) -> dict[str, Any]:
    node = SCHEMA
    for name in path.strip(".").split("."):
        node = node["properties"][name]
    return node


def rules_at(path: str) -> list[dict[str, str]]:
    return (SCHEMA if path == "" else node_at(path)).get("x-kubernetes-validations", [])


# --- the generated files --------------------------------------------------------------

def test_committed_crds_equal_generated():
    diffs = crdgen.check()
    assert not diffs, "stale CRD files, run `make generate`:\n" + "".join(diffs)


def test_check_cli_fails_on_stale_files_and_write_fixes_them(tmp_path, capsys):
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1
    assert "+kind: CustomResourceDefinition" in capsys.readouterr().out
    assert crdgen.main(["--root", str(tmp_path)]) == 0
    assert crdgen.main(["--check", "--root", str(tmp_path)]) == 0
    for rel in crdgen.OUTPUTS:
        path = tmp_path / rel
        path.write_text(path.read_text().replace("shortNames:\n    - tj", "shortNames:\n    - tjob"))
        capsys.readouterr()
        assert crdgen.main(["--check", "--root", str(tmp_path)]) == 1
        out = capsys.readouterr().out
        assert f"{rel} (committed)" in out and "-    - tjob" in out and "+    - tj" in out
        crdgen.main(["--root", str(tmp_path)])
        assert crdgen.main(["--check", "--root", str(tmp_path)]) == 0


def test_output_is_deterministic():
    assert crdgen.render() == crdgen.render()
    assert yaml.safe_load(crdgen.render()) == crdgen.crd()


def test_crd_identity():
    crd = crdgen.crd()
    assert crd["metadata"]["name"] == "trainingjobs.transom.io"
    spec = crd["spec"]
    assert spec["group"] == "transom.io" and spec["scope"] == "Namespaced"
    assert spec["names"]["kind"] == "TrainingJob" and spec["names"]["plural"] == "trainingjobs"
    assert spec["names"]["shortNames"] == ["tj"]
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"] == {"status": {}}


# --- structural schema ----------------------------------------------------------------

def test_schema_is_structural():
    for path, node in walk(SCHEMA):
        for banned in ("$ref", "$defs", "definitions", "anyOf", "oneOf", "allOf", "not", "title", "const", "nullable"):
            assert banned not in node, f"{path or '/'}: {banned}"
        assert node.get("additionalProperties", True) is not False, path
        assert "type" in node or node.get("x-kubernetes-preserve-unknown-fields"), f"{path}: no type"
        if "properties" in node:
            assert node["type"] == "object", path
        if node.get("type") == "array":
            assert "type" in node["items"], path
        assert node.get("type") != "number", f"{path}: no floats in the API"
        for required in node.get("required", []):
            assert required in node["properties"], f"{path}: required {required} is not a property"


def test_every_field_has_a_description():
    for path, node in walk(SCHEMA):
        if path == ".metadata":  # the API server allows nothing but the type there
            assert node == {"type": "object"}
            continue
        assert node.get("description", "").strip(), f"{path or '/'}: no description"


def test_every_value_is_bounded():
    for path, node in walk(SCHEMA):
        kind = node.get("type")
        if kind == "string":
            assert "maxLength" in node, f"{path}: string without maxLength"
        elif kind == "array":
            assert "maxItems" in node, f"{path}: array without maxItems"
        elif kind == "integer":
            assert "minimum" in node and "maximum" in node, f"{path}: integer without bounds"
            # The API server holds bounds as float64: they must convert exactly.
            for bound in (node["minimum"], node["maximum"]):
                assert int(float(bound)) == bound and abs(bound) <= 2**62, f"{path}: bound {bound}"


def test_list_map_keys_are_required():
    for path, node in walk(SCHEMA):
        if node.get("x-kubernetes-list-type") == "map":
            for key in node["x-kubernetes-list-map-keys"]:
                assert key in node["items"].get("required", []), f"{path}: list-map key {key} must be required"


def test_printer_columns_point_at_fields():
    (version,) = crdgen.crd()["spec"]["versions"]
    columns = {c["name"]: c for c in version["additionalPrinterColumns"]}
    assert {"State", "Healthy", "Step", "Checkpoint", "Restarts", "Age"} <= columns.keys()
    assert columns["Age"]["jsonPath"] == ".metadata.creationTimestamp"
    for name, column in columns.items():
        if column["jsonPath"].startswith(".metadata"):
            continue
        field = node_at(column["jsonPath"])
        assert field["type"] == column["type"], name


def test_cel_rules_have_messages():
    rules = [(path, rule) for path, node in walk(SCHEMA) for rule in node.get("x-kubernetes-validations", [])]
    assert len(rules) >= 8
    for path, rule in rules:
        assert rule["rule"].strip() and rule["message"].strip(), path
        assert " must " in rule["message"] or "immutable" in rule["message"], (path, rule["message"])


def test_expected_cel_rules_are_where_they_apply():
    spec_rules = {r["rule"] for r in rules_at(".spec")}
    assert "self.minReplicas <= self.replicas" in spec_rules
    assert "self.spareReplicas <= self.replicas" in spec_rules
    assert any("self.nodesPerReplica * self.procsPerNode" in r for r in spec_rules)
    assert any("size(self.spec.containers) > 0" in r["rule"] for r in rules_at(".spec.template"))
    assert rules_at(".spec.faultTolerance")[0]["rule"] == "self.maxBackoffSeconds >= self.backoffSeconds"
    for immutable in (".spec.nodesPerReplica", ".spec.procsPerNode"):
        assert rules_at(immutable) == [{"rule": "self == oldSelf", "message": rules_at(immutable)[0]["message"]}]
    assert ".spec.replicas" not in {p for p, n in walk(SCHEMA) if n.get("x-kubernetes-validations")}
    assert any("self.metadata.name" in r["rule"] for r in rules_at(""))


def test_pod_template_is_a_passthrough():
    template = node_at(".spec.template")
    assert template["type"] == "object"
    assert template["x-kubernetes-preserve-unknown-fields"] is True
    assert template["x-kubernetes-embedded-resource"] is False
    assert "passthrough" in template["description"]
    # What it declares is typed, and nothing it does not declare is pruned.
    for path, node in walk(template, ".spec.template"):
        if node["type"] == "object" and "additionalProperties" not in node:
            assert node["x-kubernetes-preserve-unknown-fields"] is True, path


def test_the_template_may_not_choose_the_pods_service_account_or_token():
    rules = {r["fieldPath"]: r for r in rules_at(".spec.template.spec")}
    assert rules[".serviceAccountName"]["rule"] == "!has(self.serviceAccountName)"
    assert rules[".serviceAccount"]["rule"] == "!has(self.serviceAccount)"
    assert rules[".automountServiceAccountToken"]["rule"] == (
        "!has(self.automountServiceAccountToken) || !self.automountServiceAccountToken")
    # CEL sees only declared members of an object that preserves unknown fields.
    declared = node_at(".spec.template.spec")["properties"]
    assert declared["serviceAccountName"]["type"] == declared["serviceAccount"]["type"] == "string"
    assert declared["automountServiceAccountToken"]["type"] == "boolean"
    # false is what the operator sets anyway, so a template may say it.
    spec = cases.with_changes(spec__template__spec__automountServiceAccountToken=False)
    api.TrainingJob.model_validate(spec)


def test_the_models_check_the_template_against_the_schema_the_crd_carries():
    assert node_at(".spec.template") == crdgen.structural(api.POD_TEMPLATE_SCHEMA, {})
    containers = node_at(".spec.template.spec.containers")
    assert containers["items"]["required"] == ["name"] and containers["items"]["type"] == "object"
    assert f"deeper than {api.MAX_TEMPLATE_DEPTH} levels" in node_at(".spec.template")["description"]


def test_generator_refuses_what_is_not_structural():
    class Bad(BaseModel):
        value: int | str

    raw = Bad.model_json_schema()
    with pytest.raises(crdgen.SchemaError, match="value"):
        crdgen.structural(raw, raw.pop("$defs", {}))


# --- the models -----------------------------------------------------------------------

def apply_crd_defaults(schema: dict[str, Any], value: Any) -> Any:
    """What the API server's defaulting does to `value` (enough of it for this schema)."""
    if not isinstance(value, dict) or "properties" not in schema:
        return value
    out = dict(value)
    for name, sub in schema["properties"].items():
        if name not in out and "default" in sub:
            out[name] = copy.deepcopy(sub["default"])
        if name in out:
            out[name] = apply_crd_defaults(sub, out[name])
    return out


def test_valid_manifest_round_trips_in_camel_case():
    manifest = cases.VALID_MANIFEST
    job = api.TrainingJob.model_validate(manifest)
    assert job.spec.min_replicas == 2 and job.spec.fault_tolerance.node_exclusion_policy == "Taint"
    assert job.spec.checkpoint.credentials_secret.name == "s3-credentials"
    assert job.model_dump(by_alias=True, exclude_unset=True, mode="json") == manifest


def test_crd_defaults_equal_model_defaults():
    full = api.TrainingJob.model_validate(cases.VALID_MANIFEST).model_dump(by_alias=True, exclude_none=True,
                                                                           mode="json")
    assert apply_crd_defaults(SCHEMA, cases.VALID_MANIFEST) == full
    minimal = {"apiVersion": api.API_VERSION, "kind": api.KIND, "metadata": {"name": "m"},
               "spec": {"replicas": 1, "template": {"spec": {"containers": [{"name": "t"}]}}}}
    defaulted = apply_crd_defaults(SCHEMA, minimal)
    assert defaulted == api.TrainingJob.model_validate(minimal).model_dump(by_alias=True, exclude_none=True,
                                                                           mode="json")
    assert defaulted["spec"]["faultTolerance"]["nodeExclusionPolicy"] == "Exclude"


def test_models_take_snake_case_too():
    spec = api.TrainingJobSpec(replicas=2, min_replicas=1, template={"spec": {"containers": [{"name": "t"}]}})
    dumped = spec.model_dump(by_alias=True, mode="json")
    assert dumped["minReplicas"] == 1 and dumped["faultTolerance"]["maxBackoffSeconds"] == 300


def test_status_round_trips():
    status = {
        "observedGeneration": 3, "state": "Recovering", "healthy": "3/4", "healthyReplicas": 3, "totalRestarts": 1,
        "conditions": [{"type": "Recovering", "status": "True", "reason": "NodeNotReady",
                        "message": "replacing replica 2", "lastTransitionTime": "2025-05-01T10:00:00Z",
                        "observedGeneration": 3}],
        "replicas": [{"id": 2, "generation": 1, "state": "Replacing", "nodes": ["node-a", "node-b"], "restarts": 1,
                      "lastFailure": {"reason": "NodeNotReady", "message": "node-b NotReady",
                                      "time": "2025-05-01T10:00:00Z"}}],
        "excludedNodes": [{"name": "node-b", "reason": "NodeNotReady", "time": "2025-05-01T10:00:00Z"}],
        "training": {"step": 1234, "lastCheckpoint": 1200, "goodput": "0.930"},
    }
    parsed = api.TrainingJobStatus.model_validate(status)
    assert parsed.replicas[0].last_failure.reason == "NodeNotReady"
    assert parsed.model_dump(by_alias=True, exclude_unset=True, mode="json") == status


@pytest.mark.parametrize("field, value", [
    ("goodput", "0.9312"), ("goodput", "1.5"), ("goodput", "93%"), ("step", -1),
])
def test_training_progress_rejects(field, value):
    with pytest.raises(ValidationError):
        api.TrainingProgress.model_validate({field: value})


@pytest.mark.parametrize("value", ["0", "1", "0.5", "0.93", "0.930", "1.000"])
def test_goodput_accepts_decimal_strings(value):
    assert api.TrainingProgress.model_validate({"goodput": value}).goodput == value


# What the models say for each case of tests/e2e/invalid_specs.py (the API server's words
# differ for the checks pydantic makes itself; CEL rules carry the same message in both).
MODEL_ERRORS = {
    "replicas-zero": "greater than or equal to 1",
    "replicas-not-integer": "valid integer",
    "min-replicas-above-replicas": "minReplicas must be less than or equal to replicas",
    "spare-replicas-above-replicas": "spareReplicas must be less than or equal to replicas",
    "too-many-processes-per-replica": "(processes per replica) must be at most 32768",
    "too-many-pods": "(worker pods) must be at most 16384",
    "template-missing": "Field required",
    "template-without-containers": "template.spec.containers must list at least one container",
    "template-without-pod-spec": "template.spec.containers must list at least one container",
    "template-label-reserved": "must not use the transom.io/ prefix",
    "template-annotation-reserved": "must not use the transom.io/ prefix",
    "template-annotation-reserved-subdomain": "must not use the transom.io/ prefix",
    "template-label-not-a-string": "template.metadata.labels.team must be of type string",
    "template-metadata-not-an-object": "template.metadata must be of type object",
    "template-container-not-an-object": "template.spec.containers[0] must be of type object",
    "template-container-without-name": "template.spec.containers[0].name: Required value",
    "template-env-not-a-list": "template.spec.containers[0].env must be of type array",
    "template-service-account-name": "template.spec.serviceAccountName must not be set",
    "template-service-account-deprecated-alias": "template.spec.serviceAccount (the deprecated serviceAccountName)",
    "template-automount-service-account-token": "template.spec.automountServiceAccountToken must not be true",
    "checkpoint-keep-zero": "greater than or equal to 1",
    "checkpoint-relative-uri": "should match pattern",
    "checkpoint-secret-bad-name": "should match pattern",
    "max-backoff-below-backoff": "maxBackoffSeconds must be greater than or equal to backoffSeconds",
    "max-backoff-below-default-backoff": "maxBackoffSeconds must be greater than or equal to backoffSeconds",
    "unknown-exclusion-policy": "Input should be 'Exclude', 'Taint', 'Cordon' or 'None'",
    "restarts-as-float": "valid integer",
    "detection-slow-factor-not-above-one": "greater than or equal to 101",
    "detection-unknown-slow-action": "Input should be 'Replace', 'Report' or 'Rebalance'",
    "backend-unknown": "Input should be 'auto', 'gloo' or 'nccl'",
    "preflight-check-unknown": "Input should be 'compute', 'memory', 'collective', 'link', 'storage' or 'node'",
    "preflight-check-twice": "each check at most once",
    "preflight-timeout-zero": "greater than or equal to 1",
    "name-too-long": "metadata.name must be at most 40 characters",
    "name-starts-with-digit": "metadata.name must start with a lowercase letter",
}


def test_invalid_spec_table_is_complete():
    names = [case.name for case in cases.INVALID_SPECS]
    assert len(names) >= 8 and len(set(names)) == len(names)
    assert set(names) == MODEL_ERRORS.keys()
    for case in cases.INVALID_SPECS:
        assert case.error, case.name
        assert case.manifest["kind"] == "TrainingJob" and case.manifest["apiVersion"] == api.API_VERSION


@pytest.mark.parametrize("case", cases.INVALID_SPECS, ids=lambda c: c.name)
def test_models_reject_invalid_spec(case):
    with pytest.raises(ValidationError) as info:
        api.TrainingJob.model_validate(case.manifest)
    assert MODEL_ERRORS[case.name] in str(info.value)


def test_models_reject_unknown_fields():
    with pytest.raises(ValidationError, match="Extra inputs are not permitted"):
        api.TrainingJob.model_validate(cases.with_changes(spec__replica=3))


def test_invalid_updates_target_immutable_fields():
    for update in cases.INVALID_UPDATES:
        (field,) = update.changes["spec"]
        assert rules_at(f".spec.{field}")[0]["rule"] == "self == oldSelf"
        assert f"{field} is immutable" == update.error
        # The change alone is a valid spec: only the transition is refused.
        api.TrainingJob.model_validate(cases.with_changes(**{f"spec__{field}": update.changes["spec"][field]}))


def test_the_crds_backends_are_the_ones_the_library_understands():
    from typing import get_args

    from transom.contract import BACKENDS
    from transom_operator.api_base import Backend

    assert get_args(Backend) == BACKENDS


def test_the_crds_preflight_checks_are_the_ones_the_launcher_runs():
    from typing import get_args

    from transom.contract import PREFLIGHT_CHECKS
    from transom_operator.api_base import PreflightCheck

    assert get_args(PreflightCheck) == PREFLIGHT_CHECKS
    assert tuple(api.Preflight().checks) == PREFLIGHT_CHECKS  # every check by default
