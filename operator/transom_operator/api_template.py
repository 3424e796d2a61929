"""The pod template of a TrainingJob (`spec.template`): a passthrough with typed parts.

The template is a core/v1 PodTemplateSpec, kept as an object passthrough: the API server
validates the pod when the operator creates it. Only what the operator reads, and what CEL
must see, is declared, and declared once (`POD_TEMPLATE_SCHEMA`, a structural schema): the
CRD carries it, and `check_template` walks a template against the same schema in Python,
so a template the models accept is one the API server accepts and one `resources.py` can
build pods from (no AttributeError on `metadata: "x"`).

The template must not choose the pods' ServiceAccount or its token: worker pods run as the
job's own `<job>-worker` ServiceAccount, which the operator creates without any Role. A
template naming `<job>-coordinator` would otherwise hand the training script a token that
can patch the job's status.

Nesting is bounded (`MAX_TEMPLATE_DEPTH`). A structural schema with unknown fields cannot
bound it, so the API server stores a template nested hundreds of levels deep; the models
refuse it (iteratively, without recursion), and the operator reports such a job as
InvalidSpec instead of building its pods (copying it would raise RecursionError).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import WithJsonSchema

from transom.contract import RESERVED_DOMAIN, is_reserved_key
from transom_operator.api_base import MAX_CONTAINERS, Rule

MAX_TEMPLATE_KEYS = 256  # labels or annotations of the pod template (bounds the CEL cost)
# Objects and lists nested in the template, the template itself counting as 1. The deepest
# path of a core/v1 PodTemplateSpec (spec.volumes[].projected.sources[].clusterTrustBundle.
# labelSelector.matchExpressions[].values) is 13 levels deep.
MAX_TEMPLATE_DEPTH = 32
MAX_LIST = 1024  # env entries, volumes, mounts, affinity terms: far above any real pod
MAX_NAME = 1024  # an env entry's, a volume's or a ServiceAccount's name (each far shorter in practice)
MAX_UID = 2**31 - 1  # as the API server validates runAsUser


# --- schema nodes ---------------------------------------------------------------------

def _passthrough(description: str, properties: dict[str, Any] | None = None,
                 required: tuple[str, ...] = ()) -> dict[str, Any]:
    """An object whose undeclared members pass through unchecked."""
    node: dict[str, Any] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True,
                            "description": description}
    if properties:
        node["properties"] = properties
    if required:
        node["required"] = list(required)
    return node


def _list(description: str, item: dict[str, Any], max_items: int = MAX_LIST) -> dict[str, Any]:
    return {"type": "array", "maxItems": max_items, "description": description, "items": item}


def _string(description: str, max_length: int = MAX_NAME) -> dict[str, Any]:
    return {"type": "string", "maxLength": max_length, "description": description}


def _boolean(description: str) -> dict[str, Any]:
    return {"type": "boolean", "description": description}


def _uid(description: str) -> dict[str, Any]:
    return {"type": "integer", "minimum": 0, "maximum": MAX_UID, "description": description}


def _named(description: str) -> dict[str, Any]:
    """A list item the operator finds by its name (an env entry, a volume, a mount)."""
    return _passthrough(description, {"name": _string("Its name.")}, required=("name",))


# --- the template's rules -------------------------------------------------------------

def _has_container(template: dict[str, Any]) -> bool:
    pod_spec = template.get("spec")
    containers = pod_spec.get("containers") if isinstance(pod_spec, dict) else None
    return isinstance(containers, list) and len(containers) > 0


TEMPLATE_HAS_CONTAINER = Rule(
    cel="has(self.spec) && has(self.spec.containers) && size(self.spec.containers) > 0",
    message="template.spec.containers must list at least one container (the one that runs the training script)",
    check=_has_container,
)

TEMPLATE_NO_RESERVED_KEYS_MESSAGE = (
    f"template.metadata labels and annotations must not use the {RESERVED_DOMAIN}/ prefix: the operator "
    "sets those keys, and a template must not pose as it"
)

_RUNS_AS_WORKER = ("worker pods run as the job's own <job>-worker ServiceAccount, which has no API access; "
                   "give the workers credentials through checkpoint.credentialsSecret")

# On the pod spec node (`self` is template.spec). They refuse the template's word on the
# pods' identity towards the API server: the operator sets both (resources.worker_pod).
NO_SERVICE_ACCOUNT_RULES = (
    Rule("!has(self.serviceAccountName)",
         f"template.spec.serviceAccountName must not be set: {_RUNS_AS_WORKER}",
         lambda spec: spec.get("serviceAccountName") is None, ".serviceAccountName"),
    Rule("!has(self.serviceAccount)",
         f"template.spec.serviceAccount (the deprecated serviceAccountName) must not be set: {_RUNS_AS_WORKER}",
         lambda spec: spec.get("serviceAccount") is None, ".serviceAccount"),
    Rule("!has(self.automountServiceAccountToken) || !self.automountServiceAccountToken",
         "template.spec.automountServiceAccountToken must not be true: worker pods get no API token, "
         "and their <job>-worker ServiceAccount has no API access",
         lambda spec: spec.get("automountServiceAccountToken") is not True, ".automountServiceAccountToken"),
)


def _string_map(what: str) -> dict[str, Any]:
    """A labels or annotations map of the template, whose keys must not be reserved."""
    return {
        "type": "object",
        "maxProperties": MAX_TEMPLATE_KEYS,
        "additionalProperties": {"type": "string"},
        "description": f"{what} of the worker pods. Keys under {RESERVED_DOMAIN}/ are reserved for the operator.",
        "x-kubernetes-validations": [{
            "rule": f"self.all(k, !k.startsWith('{RESERVED_DOMAIN}/') && !k.contains('.{RESERVED_DOMAIN}/'))",
            "message": TEMPLATE_NO_RESERVED_KEYS_MESSAGE,
        }],
    }


def _container(what: str) -> dict[str, Any]:
    """A core/v1 Container: what the operator reads of it is typed, the rest passes through."""
    return _passthrough(f"A core/v1 Container; {what}.", {
        "name": _string("The container's name.", 63),
        "env": _list("Its environment; the operator's TRANSOM_* entries replace those of the same name.",
                     _named("A core/v1 EnvVar.")),
        "envFrom": _list("Sources of its environment; checkpoint.credentialsSecret is added.",
                         _passthrough("A core/v1 EnvFromSource.")),
        "securityContext": _passthrough("Its security context; restricted defaults fill what it leaves unset.", {
            "runAsUser": _uid("The uid its processes run as."),
            "privileged": _boolean("Whether it runs privileged."),
        }),
        "volumeMounts": _list("Its volume mounts.", _named("A core/v1 VolumeMount.")),
    }, required=("name",))


_POD_SPEC = _passthrough("The worker pod's spec (core/v1 PodSpec).", {
    "containers": _list("The pod's containers; the first one runs the Transom launcher.",
                        _container("the first one runs the Transom launcher"), MAX_CONTAINERS),
    "initContainers": _list("The pod's init containers.", _container("an init container"), MAX_CONTAINERS),
    "securityContext": _passthrough("The pod's security context; restricted defaults fill what it leaves unset.",
                                    {"runAsUser": _uid("The uid the pod's processes run as.")}),
    "affinity": _passthrough("The pod's affinity; the operator adds a rule that keeps it off excluded nodes.", {
        "nodeAffinity": _passthrough("Node affinity.", {
            "requiredDuringSchedulingIgnoredDuringExecution": _passthrough("Required node affinity.", {
                "nodeSelectorTerms": _list("Node selector terms (ORed).", _passthrough("A node selector term.", {
                    "matchExpressions": _list("Node selector requirements (ANDed).",
                                              _passthrough("A node selector requirement.")),
                })),
            }),
            "preferredDuringSchedulingIgnoredDuringExecution": _list(
                "Preferred node affinity terms.", _passthrough("A weighted node selector term.")),
        }),
    }),
    "volumes": _list("The pod's volumes.", _named("A core/v1 Volume.")),
    "serviceAccountName": _string(f"Must not be set: {_RUNS_AS_WORKER}."),
    "serviceAccount": _string("Must not be set (the deprecated serviceAccountName)."),
    "automountServiceAccountToken": _boolean("Must not be true: worker pods get no API token."),
})
_POD_SPEC["x-kubernetes-validations"] = [rule.schema() for rule in NO_SERVICE_ACCOUNT_RULES]

POD_TEMPLATE_DESCRIPTION = (
    "Pod template (a core/v1 PodTemplateSpec) of every worker pod. It is kept as an "
    "object passthrough: only the fields the operator reads are listed here, and the rest "
    "are validated when the operator creates the pods. The operator adds the transom.io labels, the TRANSOM_* "
    "environment of the launcher, a node anti-affinity for excluded nodes, the job's "
    "<job>-worker ServiceAccount with no token mounted and, where the template leaves them "
    f"unset, a restricted security context. It must not nest deeper than {MAX_TEMPLATE_DEPTH} "
    "levels of objects and lists."
)

POD_TEMPLATE_SCHEMA: dict[str, Any] = {
    **_passthrough(POD_TEMPLATE_DESCRIPTION, {
        "metadata": _passthrough("Labels and annotations for the worker pods.",
                                 {"labels": _string_map("Labels"), "annotations": _string_map("Annotations")}),
        "spec": _POD_SPEC,
    }),
    "x-kubernetes-embedded-resource": False,
    "x-kubernetes-validations": [TEMPLATE_HAS_CONTAINER.schema()],
}


# --- the same checks in Python --------------------------------------------------------

def too_deep(value: Any, limit: int = MAX_TEMPLATE_DEPTH) -> bool:
    """Whether objects and lists nest more than `limit` levels in `value` (itself level 1).
    Iterative: a value nested far beyond Python's recursion limit is answered all the same."""
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list)))
    return False


_TYPES: dict[str, tuple[type, ...]] = {
    "object": (dict,), "array": (list,), "string": (str,), "integer": (int,), "boolean": (bool,),
}


def _shape_error(value: Any, schema: dict[str, Any], path: str) -> str | None:
    """What is wrong with `value` itself (not its members) under `schema`, as the API server says it."""
    kind = schema.get("type")
    if kind is not None and (not isinstance(value, _TYPES[kind]) or (kind == "integer" and isinstance(value, bool))):
        return f"{path} must be of type {kind}"
    if "maxItems" in schema and len(value) > schema["maxItems"]:
        return f"{path} must have at most {schema['maxItems']} items"
    if "maxProperties" in schema and len(value) > schema["maxProperties"]:
        return f"{path} must have at most {schema['maxProperties']} properties"
    if "maxLength" in schema and len(value) > schema["maxLength"]:
        return f"{path} may not be longer than {schema['maxLength']}"
    if "minimum" in schema and value < schema["minimum"]:
        return f"{path} should be greater than or equal to {schema['minimum']}"
    if "maximum" in schema and value > schema["maximum"]:
        return f"{path} should be less than or equal to {schema['maximum']}"
    missing = [name for name in schema.get("required", ()) if value.get(name) is None]
    if missing:
        return f"{path}.{missing[0]}: Required value"
    return None


def shape_errors(value: Any, schema: dict[str, Any] = POD_TEMPLATE_SCHEMA, path: str = "template") -> list[str]:
    """Where `value` breaks the types and bounds of `schema` (the keywords a structural schema
    of this module uses; patterns and CEL rules are checked by their own Rules). Members the
    schema does not declare are not looked at; a null declared member counts as absent, as
    the API server prunes it."""
    errors: list[str] = []
    stack = [(value, schema, path)]
    while stack:
        node, sub, where = stack.pop()
        error = _shape_error(node, sub, where)
        if error is not None:
            errors.append(error)
            continue
        if isinstance(node, dict):
            for name, member_schema in sub.get("properties", {}).items():
                if node.get(name) is not None:
                    stack.append((node[name], member_schema, f"{where}.{name}"))
            if "additionalProperties" in sub:
                stack.extend((v, sub["additionalProperties"], f"{where}.{k}") for k, v in node.items())
        elif isinstance(node, list) and "items" in sub:
            stack.extend((item, sub["items"], f"{where}[{i}]") for i, item in enumerate(node))
    return sorted(errors)


def reserved_keys(template: dict[str, Any]) -> list[str]:
    meta = template.get("metadata") or {}
    return [f"{kind}: {key}" for kind in ("labels", "annotations") for key in meta.get(kind) or {}
            if is_reserved_key(str(key))]


def check_template(template: dict[str, Any]) -> None:
    """Raise ValueError with the first reason the API server would refuse `template` for (or,
    for its depth, the operator: the API server cannot bound it)."""
    if too_deep(template):
        raise ValueError(f"template must not nest objects and lists more than {MAX_TEMPLATE_DEPTH} levels deep")
    errors = shape_errors(template)
    if errors:
        raise ValueError("; ".join(errors[:5]))
    if not TEMPLATE_HAS_CONTAINER.check(template):
        raise ValueError(TEMPLATE_HAS_CONTAINER.message)
    for rule in NO_SERVICE_ACCOUNT_RULES:
        if not rule.check(template["spec"]):
            raise ValueError(rule.message)
    found = reserved_keys(template)
    if found:
        raise ValueError(f"{TEMPLATE_NO_RESERVED_KEYS_MESSAGE} (found {', '.join(found)})")


PodTemplate = Annotated[dict[str, Any], WithJsonSchema(POD_TEMPLATE_SCHEMA)]
