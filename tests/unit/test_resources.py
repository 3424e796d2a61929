"""Manifests built for a TrainingJob: worker pods (labels, environment, affinity, owner) and
the coordinator's objects (least-privilege Role, locked-down Deployment)."""

from __future__ import annotations

import copy
import json

import pytest
from pydantic import ValidationError

from transom import contract
from transom.job_identity import JobIdentity
from transom_operator import api, naming, resources


def make_job(**spec_overrides) -> api.TrainingJob:
    spec = {
        "replicas": 3, "minReplicas": 2, "nodesPerReplica": 2, "procsPerNode": 8,
        "template": {
            "metadata": {"labels": {"team": "llm"}, "annotations": {"a": "b"}},
            "spec": {"containers": [{"name": "trainer", "image": "trainer:1",
                                     "env": [{"name": "FOO", "value": "1"},
                                             {"name": contract.ENV_REPLICA_ID, "value": "99"}]}]},
        },
        "checkpoint": {"uri": "s3://bucket/run", "credentialsSecret": {"name": "s3-creds"}},
    }
    spec.update(spec_overrides)
    return api.TrainingJob.model_validate({
        "apiVersion": api.API_VERSION, "kind": api.KIND,
        "metadata": {"name": "demo", "namespace": "ml", "uid": "uid-1", "generation": 1},
        "spec": spec,
    })


def env_of(container):
    return {e["name"]: e for e in container["env"]}


def test_the_launcher_writes_a_script_error_where_the_container_keeps_its_termination_message():
    job = make_job()
    job.spec.template["spec"]["containers"][0]["terminationMessagePath"] = "/tmp/why"
    pod = resources.worker_pod(job, replica=0, node_rank=0, generation=0)
    assert env_of(pod["spec"]["containers"][0])[contract.ENV_TERMINATION_LOG]["value"] == "/tmp/why"


def test_worker_pod_identity_and_owner():
    pod = resources.worker_pod(make_job(), replica=1, node_rank=0, generation=4)
    meta = pod["metadata"]
    assert meta["name"] == "demo-r1-n0-g4" and meta["namespace"] == "ml"
    assert {k: meta["labels"][k] for k in (contract.LABEL_JOB, contract.LABEL_REPLICA,
                                           contract.LABEL_NODE_RANK, contract.LABEL_GENERATION)} == {
        contract.LABEL_JOB: "demo", contract.LABEL_REPLICA: "1",
        contract.LABEL_NODE_RANK: "0", contract.LABEL_GENERATION: "4",
    }
    assert meta["labels"]["team"] == "llm" and meta["annotations"] == {"a": "b"}
    assert meta["ownerReferences"] == [{
        "apiVersion": "transom.io/v1alpha1", "kind": "TrainingJob", "name": "demo", "uid": "uid-1",
        "controller": True, "blockOwnerDeletion": True,
    }]
    assert pod["spec"]["restartPolicy"] == "Never"


def test_worker_pod_environment():
    pod = resources.worker_pod(make_job(), replica=2, node_rank=1, generation=3)
    env = env_of(pod["spec"]["containers"][0])
    plain = {k: v["value"] for k, v in env.items() if "value" in v}
    assert plain == {
        "FOO": "1",
        contract.ENV_JOB: "demo", contract.ENV_JOB_UID: "uid-1", contract.ENV_NAMESPACE: "ml",
        contract.ENV_REPLICA_ID: "2",  # the operator's value wins over the template's
        contract.ENV_NUM_REPLICAS: "3", contract.ENV_REPLICA_GENERATION: "3",
        contract.ENV_NODE_RANK: "1", contract.ENV_NNODES: "2", contract.ENV_NPROC_PER_NODE: "8",
        contract.ENV_COORDINATOR_URL: "http://demo-coordinator.ml.svc:8080",
        contract.ENV_CHECKPOINT_URI: "s3://bucket/run",
        contract.ENV_CHECKPOINT_INTERVAL: "500", contract.ENV_CHECKPOINT_KEEP: "3",  # the CRD's defaults
        contract.ENV_COLLECTIVE_TIMEOUT: "60", contract.ENV_BACKEND: "auto",
        contract.ENV_DETECTION: resources.detection_json(make_job()),
        contract.ENV_PREFLIGHT: resources.preflight_json(make_job()),
        contract.ENV_IDENTITY_TOKEN_FILE: "/var/run/secrets/transom.io/identity/token",
        contract.ENV_TERMINATION_LOG: contract.TERMINATION_LOG,
    }
    assert [e["name"] for e in pod["spec"]["containers"][0]["env"]].count(contract.ENV_REPLICA_ID) == 1
    # Not the job's token, which may act for any replica: the state servers' token only.
    assert contract.ENV_COORDINATOR_TOKEN not in env
    token = env[contract.ENV_PEER_TOKEN]
    assert "value" not in token
    assert token["valueFrom"] == {"secretKeyRef": {"name": "demo-peer-token", "key": "token"}}
    assert env[contract.ENV_ADVERTISE_ADDR]["valueFrom"] == {"fieldRef": {"fieldPath": "status.podIP"}}
    assert env[contract.ENV_NODE_NAME]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}
    assert json.loads(plain[contract.ENV_PREFLIGHT]) == {
        "checks": list(contract.PREFLIGHT_CHECKS), "timeoutSeconds": 30, "spareIntervalSeconds": 300}
    assert pod["spec"]["containers"][0]["envFrom"] == [{"secretRef": {"name": "s3-creds"}}]


def test_worker_pod_environment_is_what_the_launcher_reads():
    pod = resources.worker_pod(make_job(), replica=2, node_rank=1, generation=3)
    environ = {k: v["value"] for k, v in env_of(pod["spec"]["containers"][0]).items() if "value" in v}
    got = contract.ReplicaEnv.from_environ(environ)
    assert (got.replica_id, got.num_replicas, got.generation, got.node_rank, got.nnodes, got.nproc_per_node) == (
        2, 3, 3, 1, 2, 8)
    # The job's identity, which its checkpoint location records: the TrainingJob's name and uid.
    assert JobIdentity.of(got) == JobIdentity("demo", "uid-1")


def test_worker_pod_does_not_touch_the_job():
    job = make_job()
    before = copy.deepcopy(job.spec.template)
    resources.worker_pod(job, 0, 0, 0, excluded_nodes=["n1"])
    assert job.spec.template == before


def test_no_checkpoint_gives_empty_uri_and_no_env_from():
    pod = resources.worker_pod(make_job(checkpoint=None), 0, 0, 0)
    container = pod["spec"]["containers"][0]
    assert env_of(container)[contract.ENV_CHECKPOINT_URI]["value"] == ""
    assert contract.ENV_CHECKPOINT_INTERVAL not in env_of(container)
    assert "envFrom" not in container


NOT_IN = {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": ["a", "b"]}


@pytest.mark.parametrize("template_affinity, expected", [
    (None, {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [NOT_IN]}]}}}),
    # the template's terms are ORed: the exclusion is ANDed into each of them
    ({"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]},
        {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}]},
    ]}}, "podAffinity": {"x": 1}},
     {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
         {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}, NOT_IN]},
         {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h200"]}, NOT_IN]},
     ]}}, "podAffinity": {"x": 1}}),
    ({"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}]}},
     {"nodeAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1}],
                       "requiredDuringSchedulingIgnoredDuringExecution": {
                           "nodeSelectorTerms": [{"matchExpressions": [NOT_IN]}]}}}),
])
def test_excluded_nodes_affinity(template_affinity, expected):
    template = make_job().spec.template
    if template_affinity:
        template = {**template, "spec": {**template["spec"], "affinity": template_affinity}}
    job = make_job(template=template)
    pod = resources.worker_pod(job, 0, 0, 0, excluded_nodes=["b", "a", "b"])
    assert pod["spec"]["affinity"] == expected


def test_no_excluded_nodes_adds_no_affinity():
    assert "affinity" not in resources.worker_pod(make_job(), 0, 0, 0)["spec"]


def test_owner_needs_uid():
    job = make_job()
    job.metadata.pop("uid")
    with pytest.raises(ValueError, match="uid"):
        resources.worker_pod(job, 0, 0, 0)


def by_kind(objs):
    return {o["kind"]: o for o in objs}


def test_coordinator_resources_are_owned_and_named():
    objs = resources.coordinator_resources(make_job(), token="s3cret", image="transom:1")
    assert [(o["kind"], o["metadata"]["name"]) for o in objs] == [
        ("Secret", "demo-coordinator-token"), ("Secret", "demo-peer-token"), ("ServiceAccount", "demo-worker"),
        ("ServiceAccount", "demo-coordinator"),
        ("Role", "demo-coordinator"), ("RoleBinding", "demo-coordinator"), ("Service", "demo-coordinator"),
        ("Deployment", "demo-coordinator")]
    for o in objs:
        assert o["metadata"]["namespace"] == "ml"
        assert o["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
        assert o["metadata"]["labels"][contract.LABEL_JOB] == "demo"
    secrets = {o["metadata"]["name"]: o["stringData"] for o in objs if o["kind"] == "Secret"}
    assert secrets["demo-coordinator-token"] == {"token": "s3cret"}
    assert secrets["demo-peer-token"]["token"] and secrets["demo-peer-token"]["token"] != "s3cret"


def test_workers_have_a_service_account_of_their_own_with_no_token_and_no_role():
    objs = resources.coordinator_resources(make_job(), token="s3cret", image="transom:1")
    (account,) = [o for o in objs if o["kind"] == "ServiceAccount" and o["metadata"]["name"] == "demo-worker"]
    assert account == resources.worker_service_account(make_job())
    assert account["automountServiceAccountToken"] is False
    meta = account["metadata"]
    assert meta["namespace"] == "ml" and meta["ownerReferences"][0]["uid"] == "uid-1"
    assert meta["labels"] == {contract.LABEL_JOB: "demo", resources.LABEL_COMPONENT: "worker",
                              resources.LABEL_MANAGED_BY: "transom-operator"}
    # No binding names it: it can do nothing in the API but what every ServiceAccount can.
    subjects = [s for o in objs if o["kind"] == "RoleBinding" for s in o["subjects"]]
    assert subjects and all(s["name"] != "demo-worker" for s in subjects)
    # It is created before the Deployment, which tells a pass that everything is there.
    kinds = [(o["kind"], o["metadata"]["name"]) for o in objs]
    assert kinds.index(("ServiceAccount", "demo-worker")) < kinds.index(("Deployment", "demo-coordinator"))


@pytest.mark.parametrize("build", [
    lambda job: resources.worker_pod(job, replica=1, node_rank=0, generation=2),
    lambda job: resources.spare_pod(job, spare=0, node_rank=1, generation=0),
], ids=["worker", "spare"])
def test_worker_and_spare_pods_run_as_the_worker_service_account_without_a_token(build):
    pod = build(make_job())["spec"]
    assert pod["serviceAccountName"] == naming.worker_service_account("demo") == "demo-worker"
    assert pod["automountServiceAccountToken"] is False and "serviceAccount" not in pod


def test_a_stored_template_that_names_a_service_account_is_overridden():
    # A job stored before the schema refused it: its pods still run as the worker account.
    job = make_job()
    job.spec.template["spec"].update(serviceAccountName="demo-coordinator", serviceAccount="demo-coordinator",
                                     automountServiceAccountToken=True)
    pod = resources.worker_pod(job, replica=0, node_rank=0, generation=0)["spec"]
    assert pod["serviceAccountName"] == "demo-worker"
    assert pod["automountServiceAccountToken"] is False and "serviceAccount" not in pod


def nested(depth: int) -> dict:
    """A dict `depth` levels deep, built without recursion."""
    root: dict = {}
    node = root
    for _ in range(depth - 1):
        node["a"] = {}
        node = node["a"]
    return root


@pytest.mark.parametrize("depth", [600, 100_000])
def test_a_deeply_nested_template_is_refused_with_a_message_not_a_recursion_error(depth):
    template = {"spec": {"containers": [{"name": "t", "image": "t", "x": nested(depth)}]}}
    with pytest.raises(ValidationError, match="must not nest objects and lists more than 32 levels deep"):
        make_job(template=template)


def test_the_deepest_pod_template_path_is_accepted_and_built():
    # spec.volumes[].projected.sources[].clusterTrustBundle.labelSelector.matchExpressions[].values
    selector = {"matchExpressions": [{"key": "k", "operator": "In", "values": ["v"]}]}
    volume = {"name": "trust", "projected": {"sources": [{"clusterTrustBundle": {"labelSelector": selector}}]}}
    template = {"spec": {"containers": [{"name": "t", "image": "t"}], "volumes": [volume]}}
    api.check_template(template)  # raises nothing
    pod = resources.worker_pod(make_job(template=template), 0, 0, 0)
    assert [v for v in pod["spec"]["volumes"] if v["name"] != resources.IDENTITY_VOLUME] == [volume]


@pytest.mark.parametrize("template, error", [
    ({"metadata": "x", "spec": {"containers": [{"name": "t"}]}}, "template.metadata must be of type object"),
    ({"metadata": {"annotations": ["a"]}, "spec": {"containers": [{"name": "t"}]}},
     "template.metadata.annotations must be of type object"),
    ({"spec": "x"}, "template.spec must be of type object"),
    ({"spec": {"containers": "t"}}, "template.spec.containers must be of type array"),
    ({"spec": {"containers": ["t"]}}, "template.spec.containers[0] must be of type object"),
    ({"spec": {"containers": [{"image": "t"}]}}, "template.spec.containers[0].name: Required value"),
    ({"spec": {"containers": [{"name": "t", "env": {"A": "1"}}]}}, "template.spec.containers[0].env must be of type"),
    ({"spec": {"containers": [{"name": "t", "env": ["A=1"]}]}}, "template.spec.containers[0].env[0] must be of type"),
    ({"spec": {"containers": [{"name": "t", "envFrom": "s"}]}}, "template.spec.containers[0].envFrom must be of type"),
    ({"spec": {"containers": [{"name": "t", "securityContext": "root"}]}},
     "template.spec.containers[0].securityContext must be of type object"),
    ({"spec": {"containers": [{"name": "t", "securityContext": {"privileged": "false"}}]}},
     "template.spec.containers[0].securityContext.privileged must be of type boolean"),
    ({"spec": {"initContainers": [{"name": "i", "volumeMounts": [{"mountPath": "/x"}]}],
               "containers": [{"name": "t"}]}}, "template.spec.initContainers[0].volumeMounts[0].name: Required value"),
    ({"spec": {"containers": [{"name": "t"}], "securityContext": {"runAsUser": "0"}}},
     "template.spec.securityContext.runAsUser must be of type integer"),
    ({"spec": {"containers": [{"name": "t"}], "affinity": {"nodeAffinity": "gpu"}}},
     "template.spec.affinity.nodeAffinity must be of type object"),
    ({"spec": {"containers": [{"name": "t"}], "affinity": {"nodeAffinity": {
        "preferredDuringSchedulingIgnoredDuringExecution": {"weight": 1}}}}},
     "preferredDuringSchedulingIgnoredDuringExecution must be of type array"),
    ({"spec": {"containers": [{"name": "t"}], "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [[]]}}}}},
     "nodeSelectorTerms[0] must be of type object"),
    ({"spec": {"containers": [{"name": "t"}], "volumes": [{"emptyDir": {}}]}},
     "template.spec.volumes[0].name: Required value"),
])
def test_template_type_errors_in_what_the_operator_reads_are_refused(template, error):
    with pytest.raises(ValidationError) as info:
        make_job(template=template)
    assert error in str(info.value)


def test_null_members_count_as_absent_as_the_api_server_prunes_them():
    template = {"metadata": {"labels": None}, "spec": {
        "containers": [{"name": "t", "image": "t", "securityContext": None, "env": None}],
        "securityContext": None, "affinity": {"nodeAffinity": None}}}
    pod = resources.worker_pod(make_job(template=template), 0, 0, 0, excluded_nodes=["a"], avoid_nodes=["b"])["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def test_coordinator_role_is_least_privilege():
    role = resources.coordinator_role(make_job())
    rules = {(tuple(r["apiGroups"]), tuple(r["resources"])): r for r in role["rules"]}
    status = rules[(("transom.io",), ("trainingjobs/status",))]
    assert status["resourceNames"] == ["demo"] and sorted(status["verbs"]) == ["get", "patch"]
    assert rules[(("transom.io",), ("trainingjobs",))]["resourceNames"] == ["demo"]
    # It writes status.training (verdicts included) and Events, and reads a pod whose token a
    # caller presents (which replica it is); it never changes a pod.
    assert {res for r in role["rules"] for res in r["resources"]} == {"trainingjobs", "trainingjobs/status", "events",
                                                                      "pods"}
    assert [r["verbs"] for r in role["rules"] if r["resources"] == ["pods"]] == [["get"]]
    for r in role["rules"]:
        broad = {"*", "delete", "create", "list", "watch", "update"} & set(r["verbs"])
        assert not broad or r["resources"] == ["events"]
        assert "*" not in r["resources"] and "*" not in r["apiGroups"]
    binding = resources.coordinator_role_binding(make_job())
    assert binding["roleRef"]["name"] == "demo-coordinator"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-coordinator", "namespace": "ml"}]


def test_worker_pod_is_restricted_where_the_template_is_silent():
    pod = resources.worker_pod(make_job(), replica=0, node_rank=0, generation=0)["spec"]
    assert pod["automountServiceAccountToken"] is False
    assert pod["securityContext"] == {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}}
    sc = pod["containers"][0]["securityContext"]
    assert sc == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_worker_pod_keeps_what_the_template_asks_for():
    template = {"spec": {
        "securityContext": {"runAsUser": 0, "seccompProfile": {"type": "Unconfined"}},
        "initContainers": [{"name": "setup", "image": "i", "securityContext": {"privileged": True}}],
        "containers": [{"name": "trainer", "image": "t", "securityContext": {
            "capabilities": {"add": ["IPC_LOCK"]}, "allowPrivilegeEscalation": True}}],
    }}
    pod = resources.worker_pod(make_job(template=template), replica=0, node_rank=0, generation=0)["spec"]
    assert pod["securityContext"] == {"runAsUser": 0, "seccompProfile": {"type": "Unconfined"}}  # no runAsNonRoot
    assert pod["initContainers"][0]["securityContext"] == {"privileged": True}  # no contradicting default
    assert pod["containers"][0]["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]},
                                                       "allowPrivilegeEscalation": True}


def test_network_policy_admits_only_the_jobs_own_pods():
    policy = resources.network_policy(make_job())
    assert policy["metadata"]["name"] == "demo-isolation" and policy["metadata"]["namespace"] == "ml"
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    spec = policy["spec"]
    mine = {"matchLabels": {contract.LABEL_JOB: "demo"}}
    assert spec["podSelector"] == mine and spec["policyTypes"] == ["Ingress"]
    assert spec["ingress"] == [{"from": [{"podSelector": mine}]}]
    # Every pod the job owns carries the label the policy selects.
    worker = resources.worker_pod(make_job(), replica=0, node_rank=0, generation=0)
    coordinator = resources.coordinator_deployment(make_job(), image="t:1")["spec"]["template"]
    for labels in (worker["metadata"]["labels"], coordinator["metadata"]["labels"]):
        assert mine["matchLabels"].items() <= labels.items()


def test_coordinator_deployment_is_locked_down():
    dep = resources.coordinator_deployment(make_job(), image="transom:1")
    spec = dep["spec"]
    assert spec["replicas"] == 1 and spec["strategy"] == {"type": "Recreate"}
    pod = spec["template"]["spec"]
    assert spec["selector"]["matchLabels"].items() <= spec["template"]["metadata"]["labels"].items()
    assert pod["serviceAccountName"] == "demo-coordinator"
    assert pod["securityContext"]["runAsNonRoot"] is True
    (c,) = pod["containers"]
    sc = c["securityContext"]
    assert sc["runAsNonRoot"] and sc["readOnlyRootFilesystem"] and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # Ready when it can decide rounds now; alive while its loop answers: two questions.
    assert (c["readinessProbe"]["httpGet"]["path"], c["livenessProbe"]["httpGet"]["path"]) == ("/readyz", "/healthz")
    assert c["resources"]["requests"] and c["resources"]["limits"]
    assert c["resources"]["limits"]["ephemeral-storage"] and pod["volumes"][0]["emptyDir"]["sizeLimit"]
    assert c["command"] == ["transom", "coordinator", "--port", "8080", "--job", "demo", "--replicas", "3",
                            "--min-replicas", "2", "--heartbeat-timeout", "30",
                            "--detection", resources.detection_json(make_job()), "--kube-status",
                            "--worker-service-account", "demo-worker"]
    token = env_of(c)[contract.ENV_COORDINATOR_TOKEN]
    assert token["valueFrom"]["secretKeyRef"] == {"name": "demo-coordinator-token", "key": "token"}


def test_the_coordinator_leaves_a_lost_node_within_seconds_not_the_default_five_minutes():
    """Its own NoExecute tolerations of the node controller's taints replace the 300 s that
    admission would give it: the Deployment starts it elsewhere soon after the node is lost."""
    pod = resources.coordinator_deployment(make_job(), image="transom:1")["spec"]["template"]["spec"]
    wait = resources.COORDINATOR_NODE_LOSS_TOLERATION_S
    assert pod["tolerations"] == [
        {"key": "node.kubernetes.io/not-ready", "operator": "Exists", "effect": "NoExecute", "tolerationSeconds": wait},
        {"key": "node.kubernetes.io/unreachable", "operator": "Exists", "effect": "NoExecute",
         "tolerationSeconds": wait},
    ]
    # Back before that node's replicas are replaced (the default nodeNotReadyGraceSeconds).
    assert 0 < wait < make_job().spec.fault_tolerance.node_not_ready_grace_seconds


def test_worker_pods_keep_the_default_tolerations_the_operator_acts_first():
    """Worker pods on a NotReady node are replaced by the operator after nodeNotReadyGraceSeconds
    (30 s by default), long before the taint manager's 300 s; a template's tolerations stay its own."""
    job = make_job(template={"spec": {"containers": [{"name": "t", "image": "t"}],
                                      "tolerations": [{"key": "gpu", "operator": "Exists"}]}})
    assert resources.worker_pod(job, 0, 0, 0)["spec"]["tolerations"] == [{"key": "gpu", "operator": "Exists"}]
    assert "tolerations" not in resources.worker_pod(make_job(), 0, 0, 0)["spec"]


def test_coordinator_command_parses_with_the_cli():
    from transom import cli

    command = resources.coordinator_command(make_job())
    args = cli.parser().parse_args(command[1:])
    settings = cli.coordinator_settings(args)  # the flags as the coordinator's model reads them
    assert (args.cmd, args.port, settings.job, settings.num_replicas, settings.min_replicas,
            settings.heartbeat_timeout_s) == ("coordinator", 8080, "demo", 3, 2, 30.0)


def test_coordinator_service_selects_the_deployment_pods():
    job = make_job()
    svc = resources.coordinator_service(job)
    dep = resources.coordinator_deployment(job, image="transom:1")
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert svc["spec"]["ports"][0]["port"] == naming.COORDINATOR_PORT
    assert svc["spec"]["type"] == "ClusterIP"


def test_empty_token_is_refused():
    with pytest.raises(ValueError):
        resources.coordinator_secret(make_job(), "")


def test_spec_detection_reaches_the_coordinator_and_every_worker_as_the_detectors_read_it():
    from transom.detect.step_rows import DetectionSettings

    default = make_job()
    assert DetectionSettings.from_spec(resources.detection_json(default)) == DetectionSettings()
    job = make_job(detection={"hangTimeoutSeconds": 90, "slowFactorPercent": 130, "action": "Report",
                              "fingerprintInterval": 0})
    wanted = DetectionSettings(hang_timeout_s=90, slow_factor=1.3, action="Report", fingerprint_interval=0)
    env = env_of(resources.worker_pod(job, 0, 0, 0, coordinator_url="http://c")["spec"]["containers"][0])
    assert DetectionSettings.from_spec(env[contract.ENV_DETECTION]["value"]) == wanted
    command = resources.coordinator_command(job)
    assert DetectionSettings.from_spec(command[command.index("--detection") + 1]) == wanted


def test_every_container_gets_the_pods_own_audience_bound_identity_token():
    pod = resources.worker_pod(make_job(), replica=2, node_rank=1, generation=3)
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == resources.IDENTITY_VOLUME]
    (source,) = volume["projected"]["sources"]
    assert source == {"serviceAccountToken": {"audience": "transom.io/ml/demo", "expirationSeconds": 3600,
                                              "path": "token"}}
    for c in [*pod["spec"].get("initContainers", []), *pod["spec"]["containers"]]:
        mounts = [m for m in c["volumeMounts"] if m["name"] == resources.IDENTITY_VOLUME]
        assert mounts == [{"name": resources.IDENTITY_VOLUME, "mountPath": contract.IDENTITY_TOKEN_DIR,
                           "readOnly": True}]
    assert pod["spec"]["serviceAccountName"] == "demo-worker"  # the token is the worker account's


def test_the_coordinator_reviews_its_pods_tokens_and_nothing_more():
    job = make_job()
    binding = resources.token_review_binding(job, "transom-operator-token-reviewer")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                                  "name": "transom-operator-token-reviewer"}
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "demo-coordinator", "namespace": "ml"}]
    assert binding["metadata"]["name"] == "transom-ml-demo-token-review"
    assert binding["metadata"]["labels"][resources.LABEL_NAMESPACE] == "ml"
    assert "ownerReferences" not in binding["metadata"]  # cluster-wide: the operator deletes it
    command = resources.coordinator_command(job)
    assert command[command.index("--worker-service-account") + 1] == "demo-worker"
