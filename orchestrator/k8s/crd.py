"""The Kubernetes manifests of the operator: the TfsnJob CRD, least-privilege RBAC and the Deployment.

The CRD's `spec` schema is generated from `JobSpec` (train.yaml) and its `status` schema from
`TfsnJobStatus`, so neither is written twice. The API server wants a *structural* OpenAPI v3 schema
(no `$ref`, a type on every node, no `type` inside `anyOf`), so pydantic's JSON schema is converted by
`structural_schema`. Where the model accepts forms its JSON schema does not show (a before-validator:
`cpus: 16+`, `accelerators: H100:8` or a list or a mapping, `max_hourly_cost: "$40"`), the node is left
open (`x-kubernetes-preserve-unknown-fields`; a count, `num_nodes: "2"`, is `x-kubernetes-int-or-string`
with its bounds) and the operator's validation with the model itself says what is wrong, in a status
condition.
"""
from __future__ import annotations

import types
import typing
from typing import Any, Sequence

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PlainValidator, WrapValidator
from pydantic.alias_generators import to_camel

from orchestrator.spec import JobSpec
from providers.bootstrap import install_command

GROUP = "tfsn.dev"
VERSION = "v1alpha1"
KIND = "TfsnJob"
PLURAL = "tfsnjobs"
OPERATOR = "tfsn-operator"
CA_SECRET = f"{OPERATOR}-ca"    # the CA of the operator's API, in its namespace (orchestrator.k8s.runtime)
API_PORT = 8080                 # agents in worker pods report here, as to the local controller
LIVENESS_PORT = 8081            # kopf's liveness endpoint (`tfsn operator run` serves it)
DEFAULT_IMAGE = "python:3.11-slim"   # tfsn[k8s] is installed on start where the image lacks it
# Like worker pods: a site with a prebuilt image or a wheel mirror sets --image or TFSN_INSTALL_SPEC.
OPERATOR_COMMAND = ["/bin/sh", "-c", install_command(default="tfsn[k8s]") + "; exec tfsn operator run"]
_KEEP = ("description", "minimum", "maximum", "enum", "pattern", "minLength", "maxLength", "minItems",
         "maxItems", "format")


class _Status(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")


class Condition(_Status):
    """One Kubernetes-style condition (kubectl describe shows them)."""

    type: str
    status: typing.Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str = ""


class NodeStatus(_Status):
    """One tfsn node of the job: its pod, the Kubernetes node the pod ran on, and what the controller
    knows of it (a new operator re-creates the node from this and takes its agent's reports)."""

    id: str
    rank: int | None = None
    state: str
    pod: str = ""
    host: str = ""
    failure: str = ""
    tainted: bool = False
    addr: str = ""                          # the address its agent reported (rank 0's: the rendezvous)
    offer: dict[str, Any] | None = None     # the planned offer its pod was asked for on
    heard: bool = False                     # its agent has reported at least once
    created_at: float = 0.0
    updated_at: float = 0.0                 # its last change (the controller tells this attempt's failures by it)
    provisioned_at: float | None = None     # when its pod was created
    released: bool = False                  # its pod's deletion was confirmed


class CheckpointStatus(_Status):
    step: int | None = None
    path: str = ""


class JobRecord(_Status):
    """The rest of the controller's job, for an operator that starts with an empty store."""

    spec: dict[str, Any] = Field(default_factory=dict)            # the JobSpec it started with (as JSON)
    attempt_state: str = "idle"             # idle | running | stopping
    attempt_changed_at: float = 0.0
    attempt_started_at: float = 0.0
    master_port: int = 0
    stop_requested: bool = False
    last_failure: str = ""                  # signature of the previous attempt's failure
    restored_step: int | None = None
    step_time: float | None = None
    checkpoint_at: float = 0.0
    checkpoint_request: float = 0.0
    pending_replace: str = ""               # node to replace once the requested checkpoint is saved
    pending_reason: str = ""
    plan: list[dict[str, Any]] = Field(default_factory=list)      # ranked candidates for failover
    blocked: list[dict[str, Any]] = Field(default_factory=list)   # offers ruled out by failed requests
    health: dict[str, Any] = Field(default_factory=dict)          # the health policy's state (Policy.state())
    created_at: float = 0.0
    finished_at: float | None = None


class TfsnJobStatus(_Status):
    """The durable store of the job: the controller's job and nodes, written by the operator whenever
    they change, from which an operator with an empty store carries the job on."""

    phase: str = ""
    job_id: int | None = None
    attempt: int = 0
    step: int = 0
    restarts: int = 0
    checkpoint: CheckpointStatus = Field(default_factory=CheckpointStatus)
    nodes: list[NodeStatus] = Field(default_factory=list)
    record: JobRecord | None = None
    conditions: list[Condition] = Field(default_factory=list)
    message: str = ""


def known_fields(model: type[BaseModel], data: Any) -> Any:
    """`data` without the keys `model` has no field for, at every level: a status written by a newer
    operator read by an older one (pydantic before 2.12 has no per-call `extra`)."""
    if not isinstance(data, dict):
        return data
    out = {}
    for name, field in model.model_fields.items():
        key = field.alias or name
        if key not in data:
            continue
        annotation, value = field.annotation, data[key]
        if typing.get_origin(annotation) is list and isinstance(value, list):
            inner = _model_of(typing.get_args(annotation)[0])
            out[key] = [known_fields(inner, v) for v in value] if inner else value
        else:
            inner = _model_of(annotation)
            out[key] = known_fields(inner, value) if inner else value
    return out


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model a field holds (also `Model | None`), else None."""
    args = typing.get_args(annotation) if isinstance(annotation, types.UnionType) or \
        typing.get_origin(annotation) is typing.Union else (annotation,)
    models = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
    others = [a for a in args if a is not type(None) and a not in models]
    return models[0] if len(models) == 1 and not others else None


def _before_validated(model: type[BaseModel]) -> set[str]:
    """Fields of `model` that a mode='before' validator reads: they take more forms than their type."""
    names: set[str] = set()
    for decorator in model.__pydantic_decorators__.field_validators.values():
        if decorator.info.mode in ("before", "wrap", "plain"):
            names.update(decorator.info.fields)
    return names


def _opened(annotation: Any, metadata: Sequence[Any], node: dict[str, Any]) -> dict[str, Any]:
    """`node`, the structural schema of a field typed `annotation` (`metadata`: its Annotated parts), opened where a
    before-validator of that type (or of its values or items) takes more forms than the type, which pydantic's JSON
    schema does not show (`max_hourly_cost: "$40"`, `num_nodes: "2"`): a count stays an integer with its bounds,
    or text; anything else is left to the model."""
    if any(isinstance(part, (BeforeValidator, WrapValidator, PlainValidator)) for part in metadata):
        nullable = {"nullable": True} if node.get("nullable") else {}
        if node.get("type") == "integer":
            return {**{k: v for k, v in node.items() if k != "type"}, "x-kubernetes-int-or-string": True}
        return {"x-kubernetes-preserve-unknown-fields": True, **nullable}
    if typing.get_origin(annotation) is typing.Annotated:
        return _opened(typing.get_args(annotation)[0], annotation.__metadata__, node)
    if typing.get_origin(annotation) is dict and isinstance(node.get("additionalProperties"), dict):
        return {**node, "additionalProperties": _opened(typing.get_args(annotation)[1], (),
                                                        node["additionalProperties"])}
    if typing.get_origin(annotation) is list and "items" in node:
        return {**node, "items": _opened(typing.get_args(annotation)[0], (), node["items"])}
    return node


def _node(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One JSON-schema node as a structural OpenAPI node."""
    if "$ref" in schema:
        return _node(defs[schema["$ref"].rsplit("/", 1)[-1]], defs)
    if "anyOf" in schema:
        arms = [arm for arm in schema["anyOf"] if arm.get("type") != "null"]
        nullable = len(arms) < len(schema["anyOf"])
        if len(arms) == 1:
            out = _node({**arms[0], **{k: v for k, v in schema.items() if k == "description"}}, defs)
        elif {arm.get("type") for arm in arms} == {"integer", "string"}:
            out = {"x-kubernetes-int-or-string": True}
        else:                       # several shapes: the model decides
            out = {"x-kubernetes-preserve-unknown-fields": True}
        return {**out, "nullable": True} if nullable else out
    out: dict[str, Any] = {k: schema[k] for k in _KEEP if k in schema}
    if "const" in schema:
        out["enum"] = [schema["const"]]
    if "exclusiveMinimum" in schema:  # JSON Schema's number form; OpenAPI v3.0 has a flag
        out.update(minimum=schema["exclusiveMinimum"], exclusiveMinimum=True)
    kind = schema.get("type")
    if kind == "object" and "properties" in schema:
        out.update(type="object", properties={k: _node(v, defs) for k, v in schema["properties"].items()})
        if schema.get("required"):
            out["required"] = list(schema["required"])
    elif kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        out.update(type="object", additionalProperties=_node(schema["additionalProperties"], defs))
    elif kind == "object" or kind is None:
        out["x-kubernetes-preserve-unknown-fields"] = True
        if kind:
            out["type"] = kind
    elif kind == "array":
        out.update(type="array", items=_node(schema.get("items", {}), defs))
    else:
        out["type"] = kind
    return out


def structural_schema(model: type[BaseModel], optional: tuple[str, ...] = ()) -> dict[str, Any]:
    """`model`'s validation schema as a structural OpenAPI v3 schema (see the module docstring);
    `optional` fields are not required (the operator fills them in)."""
    full = model.model_json_schema(by_alias=True)
    defs = full.get("$defs", {})

    def convert(cls: type[BaseModel], schema: dict[str, Any]) -> dict[str, Any]:
        loose = _before_validated(cls)
        properties = {}
        for name, field in cls.model_fields.items():
            key = field.alias or name
            sub = schema["properties"][key]
            inner = _model_of(field.annotation)
            section = inner is not None and field.annotation is inner   # always there, never None
            if section:        # its own fields carry the schema; a before-validator may only fill in an empty one
                nullable = {"nullable": True} if name in loose else {}
                properties[key] = {**convert(inner, _resolve(sub, defs)), **nullable}
            elif name in loose:
                properties[key] = {"x-kubernetes-preserve-unknown-fields": True}
            elif inner is not None:
                properties[key] = {**convert(inner, _resolve(sub, defs)), "nullable": True}
            else:
                properties[key] = _opened(field.annotation, field.metadata, _node(sub, defs))
        out: dict[str, Any] = {"type": "object", "properties": properties}
        if cls.__doc__:
            out["description"] = " ".join(cls.__doc__.split("\n\n")[0].split())
        required = [k for k in schema.get("required", []) if k not in optional or cls is not model]
        if required:
            out["required"] = required
        return out

    return convert(model, full)


def _resolve(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """The object schema behind a `$ref` or an `anyOf: [$ref, null]`."""
    if "$ref" in schema:
        return defs[schema["$ref"].rsplit("/", 1)[-1]]
    arm = next(a for a in schema.get("anyOf", []) if a.get("type") != "null")
    return _resolve(arm, defs)


def crd() -> dict[str, Any]:
    """The TfsnJob CustomResourceDefinition: spec = train.yaml, a status subresource, printer columns."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP, "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": KIND.lower(), "shortNames": ["tj"],
                      "categories": ["tfsn"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": [
                    {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
                    {"name": "Step", "type": "integer", "jsonPath": ".status.step"},
                    {"name": "Restarts", "type": "integer", "jsonPath": ".status.restarts"},
                    {"name": "Checkpoint", "type": "integer", "jsonPath": ".status.checkpoint.step"},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}],
                "schema": {"openAPIV3Schema": {
                    "type": "object", "description": "A tfsn training job (train.yaml as a Kubernetes resource).",
                    "properties": {
                        "spec": structural_schema(JobSpec, optional=("name",)),
                        # kopf keeps its own progress notes under status.kopf: leave them unpruned.
                        "status": {**structural_schema(TfsnJobStatus), "x-kubernetes-preserve-unknown-fields": True},
                    },
                    "required": ["spec"]}},
            }],
        },
    }


def rbac(namespace: str, watch: str = "") -> list[dict[str, Any]]:
    """The operator's ServiceAccount and the least it may do: TfsnJobs, their pods, Services, Secrets and events
    (a Role in the `watch` namespace when it runs for that one only, else cluster-wide), read/taint nodes
    (cluster-scoped, hence a ClusterRole), and its own CA's Secret in `namespace`."""
    job_rules = [
        {"apiGroups": [GROUP], "resources": [PLURAL], "verbs": ["get", "list", "watch", "patch"]},
        {"apiGroups": [GROUP], "resources": [f"{PLURAL}/status"], "verbs": ["get", "patch"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch", "create", "delete"]},
        {"apiGroups": [""], "resources": ["services"], "verbs": ["get", "create"]},
        # Each job's token Secret (its name is made from the TfsnJob's, so it cannot be listed here): create it,
        # patch in the new job's token, get it back when a new operator adopts the job. No list, watch, update
        # or delete: the operator sees no Secret it does not name, and owner references delete its own.
        {"apiGroups": [""], "resources": ["secrets"], "verbs": ["get", "create", "patch"]},
        {"apiGroups": ["", "events.k8s.io"], "resources": ["events"], "verbs": ["create"]},
    ]
    cluster_rules = [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "list", "patch"]},
        # kopf watches for CRDs and namespaces appearing while it runs
        {"apiGroups": ["apiextensions.k8s.io"], "resources": ["customresourcedefinitions"],
         "verbs": ["list", "watch"]},
        {"apiGroups": [""], "resources": ["namespaces"], "verbs": ["list", "watch"]},
    ]
    # The API's CA, kept across operators: read by its name; created once (create cannot be limited by name).
    ca_rules = [{"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": [CA_SECRET]},
                {"apiGroups": [""], "resources": ["secrets"], "verbs": ["create"]}]
    meta = {"name": OPERATOR, "labels": {"app.kubernetes.io/name": OPERATOR}}
    account = {"kind": "ServiceAccount", "name": OPERATOR, "namespace": namespace}
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {**meta, "namespace": namespace}},
        *_grant("ClusterRole", meta, cluster_rules if watch else job_rules + cluster_rules, account),
        *(_grant("Role", {**meta, "namespace": watch}, job_rules, account) if watch else []),
        *_grant("Role", {**meta, "name": CA_SECRET, "namespace": namespace}, ca_rules, account),
    ]


def _grant(kind: str, meta: dict[str, Any], rules: list[dict[str, Any]], account: dict[str, str]) -> list[dict]:
    """A Role or ClusterRole with `rules`, and its binding to the operator's ServiceAccount."""
    api = "rbac.authorization.k8s.io"
    return [{"apiVersion": f"{api}/v1", "kind": kind, "metadata": meta, "rules": rules},
            {"apiVersion": f"{api}/v1", "kind": f"{kind}Binding", "metadata": meta,
             "roleRef": {"apiGroup": api, "kind": kind, "name": meta["name"]}, "subjects": [account]}]


def deployment(namespace: str, image: str = DEFAULT_IMAGE, checkpoint_claim: str = "",
               watch: str = "") -> list[dict[str, Any]]:
    """One operator replica (kopf runs one per cluster, or one for the `watch` namespace) and the Service agents
    report to."""
    labels = {"app.kubernetes.io/name": OPERATOR}
    env = [{"name": "TFSN_OPERATOR_ADVERTISE", "value": f"{OPERATOR}.{namespace}.svc"},
           {"name": "TFSN_OPERATOR_PORT", "value": str(API_PORT)},
           {"name": "TFSN_HOME", "value": "/var/lib/tfsn"}]
    if checkpoint_claim:
        env.append({"name": "TFSN_OPERATOR_CHECKPOINT_CLAIM", "value": checkpoint_claim})
    if watch:
        env.append({"name": "TFSN_OPERATOR_NAMESPACE", "value": watch})
    return [
        {"apiVersion": "apps/v1", "kind": "Deployment",
         "metadata": {"name": OPERATOR, "namespace": namespace, "labels": labels},
         "spec": {"replicas": 1, "strategy": {"type": "Recreate"}, "selector": {"matchLabels": labels},
                  "template": {"metadata": {"labels": labels}, "spec": {
                      "serviceAccountName": OPERATOR,
                      "containers": [{
                          "name": "operator", "image": image, "command": OPERATOR_COMMAND,
                          "env": env, "ports": [{"name": "api", "containerPort": API_PORT}],
                          "livenessProbe": {"httpGet": {"path": "/healthz", "port": LIVENESS_PORT},
                                            "periodSeconds": 30},
                          "volumeMounts": [{"name": "home", "mountPath": "/var/lib/tfsn"}],
                          "resources": {"requests": {"cpu": "100m", "memory": "256Mi"}}}],
                      # The controller's working store: a cache, rebuilt from the TfsnJobs' status (the
                      # durable store) when this pod is replaced.
                      "volumes": [{"name": "home", "emptyDir": {}}]}}}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {"name": OPERATOR, "namespace": namespace, "labels": labels},
         "spec": {"selector": labels, "ports": [{"name": "api", "port": API_PORT, "targetPort": API_PORT}]}},
    ]


def manifests(namespace: str = "tfsn-system", image: str = DEFAULT_IMAGE, checkpoint_claim: str = "",
              watch: str = "") -> list[dict]:
    """Everything `kubectl apply` needs to install the operator, in apply order; `watch`: the one namespace
    whose TfsnJobs it runs ("": every namespace)."""
    return [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}}, crd(),
            *rbac(namespace, watch), *deployment(namespace, image, checkpoint_claim, watch)]
