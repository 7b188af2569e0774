"""The Kubernetes provider: a node is one pod on a cluster, created through the kubernetes client.

The pod (`restartPolicy: Never`: a failed node is replaced by the controller, not restarted in
place) runs the agent command with the request's environment, asks for the offer's GPUs as
`nvidia.com/gpu` limits and lands on the offer's GPU type through a node selector. Offers are the
cluster's own GPU types, read from node labels (NVIDIA GPU feature discovery, GKE); the cluster is
free unless a node carries a price annotation. The cluster and its credentials come from the
kubeconfig (or the pod's service account), never from tfsn's own settings.

Run by the operator (a `TfsnJob`), a job's pods are also *bound* (`PodBinding`): owned by the TfsnJob
so that deleting it deletes them, given the job token from a Secret instead of a plain value, the
checkpoint volume, and a headless Service's subdomain for rendezvous.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from providers.base import (AuthError, Clients, Fault, InvalidRequestError, NodeHandle, NodeRequest, NodeStatus,
                            NotFoundError, Offer, ProviderError, QuotaError, import_sdk, provider_error)
from providers.bootstrap import install_command
from providers.naming import JOB_TAG, NODE_TAG, OWNER_TAG, dns_label, node_tags
from providers.sweep import NotConfigured, TaggedResource, tagged

NAME = "kubernetes"
EXTRA = "k8s"
TIMEOUT_S = (5, 30)             # (connect, read) of every API call
RETRIES = 3                     # urllib3's bounded retries on 429/5xx and broken connections
BACKOFF_S = 0.5                 # urllib3 backoff factor: 0.5 s, 1 s, 2 s
DELETE_GRACE_S = 30             # SIGTERM to SIGKILL when a node's pod is deleted
# A CUDA image with torch; the pod installs tfsn on start if the image lacks it. TFSN_K8S_IMAGE overrides.
DEFAULT_IMAGE = "pytorch/pytorch:2.5.1-cuda12.4-cudnn9-runtime"
GPU = "nvidia.com/gpu"
# Node labels that name a node's GPU model, most specific first.
GPU_LABELS = ("nvidia.com/gpu.product", "cloud.google.com/gke-accelerator")
GPU_MEMORY_LABEL = "nvidia.com/gpu.memory"   # MiB, set by GPU feature discovery
PRICE_ANNOTATION = "tfsn.dev/price-per-hour"  # $/node-hour, set by the cluster's owner
CPU_INSTANCE = "cpu"            # the offer of nodes without GPUs: no node selector
NODE_ANNOTATION = "tfsn.dev/node-id"          # the exact node id (labels and names must be shortened)
JOB_ANNOTATION = "tfsn.dev/job-id"            # the exact job id
# Models sold in two memory sizes, named apart in the catalog (SkyPilot's names).
MEMORY_VARIANTS = {("A100", "80GB"): "A100-80GB", ("V100", "32GB"): "V100-32GB"}
PHASES = {"Pending": NodeStatus.PENDING, "Running": NodeStatus.RUNNING, "Succeeded": NodeStatus.TERMINATED,
          "Failed": NodeStatus.TERMINATED, "Unknown": NodeStatus.UNKNOWN}
UNHEALTHY_TAINT = "tfsn.dev/unhealthy"       # on a Kubernetes node a bad GPU was found on: NoSchedule
TOKEN_KEY = "token"                           # the key of the job token in a bound job's Secret
AGENT_KEY = "agent-{node_id}"                 # the key of each node's own agent token in that Secret
# Runs the request's command as is, after installing tfsn where the image lacks it.
ENTRYPOINT = ["/bin/sh", "-c", install_command() + '; exec "$@"', "tfsn-node"]


def canonical_accelerator(product: str) -> str:
    """The catalog's accelerator name of a node label value: NVIDIA-A100-SXM4-80GB and nvidia-a100-80gb
    are "A100-80GB", NVIDIA-H100-80GB-HBM3 is "H100", nvidia-tesla-t4 is "T4"."""
    words = [w for w in re.split(r"[-_ ]+", product.upper()) if w and w not in ("NVIDIA", "TESLA", "GEFORCE")]
    model = words[0] if words else product
    return next((name for (base, size), name in MEMORY_VARIANTS.items() if base == model and size in words), model)


def _quantity(value: str) -> float:
    """A Kubernetes quantity ("96", "500m", "1000Gi", "512000Ki") as a number (bytes for memory)."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "m": 1e-3}
    for suffix, factor in units.items():
        if value.endswith(suffix):
            return float(value[: -len(suffix)]) * factor
    return float(value)


def _price(node: Any) -> float:
    """The node-hour price its owner annotated, 0 (already paid for) without one."""
    text = (node.metadata.annotations or {}).get(PRICE_ANNOTATION, "0")
    try:
        return float(text)
    except ValueError:
        raise InvalidRequestError(f"node {node.metadata.name}: annotation {PRICE_ANNOTATION}={text!r} is not a "
                                  "number. To fix: set it to the node-hour price in USD, e.g. '2.5'",
                                  provider=NAME) from None


@dataclass(frozen=True)
class PodBinding:
    """What the operator adds to every pod of one job (plain data; see the module docstring)."""

    namespace: str                    # the TfsnJob's namespace: its pods live next to it
    owner: dict[str, str]             # apiVersion, kind, name, uid of the TfsnJob
    token_secret: str                 # Secret with the job token (TOKEN_KEY) and each node's agent token (AGENT_KEY)
    service: str                      # headless Service: pods are <pod>.<service>.<namespace>.svc
    checkpoint_path: str              # where the checkpoint volume is mounted (spec.checkpoint.dir)
    checkpoint_claim: str | None = None   # PersistentVolumeClaim of checkpoints; None: an emptyDir
    checkpoint_sub_path: str = ""     # the job's folder on a shared claim
    image: str | None = None          # None: TFSN_K8S_IMAGE or DEFAULT_IMAGE
    command: tuple[str, ...] = ()     # replaces the request's command (the operator's python is not the pod's)
    labels: dict[str, str] | None = None  # extra pod labels (the Service selects the job's pods by them)


class KubernetesProvider:
    """Pods as nodes (see the module docstring)."""

    name = NAME

    def __init__(self, context: str | None = None, namespace: str | None = None) -> None:
        self.context = context or os.environ.get("TFSN_K8S_CONTEXT") or None
        self._namespace = namespace or os.environ.get("TFSN_K8S_NAMESPACE") or None
        self._clients = Clients()
        self.bindings: dict[str, PodBinding] = {}   # job id -> what the operator adds to its pods
        self.hosts: dict[str, str] = {}             # node id -> the Kubernetes node its pod was scheduled on
        # Called with (node id, host) once a node's pod is deleted: the operator taints the host of a failed
        # node there, before the controller asks for its replacement.
        self.on_deleted: Callable[[str, str], None] | None = None

    def _core(self) -> Any:
        """CoreV1Api on the kubeconfig's cluster (or the pod's service account), with bounded retries."""
        def make() -> Any:
            kubernetes = import_sdk("kubernetes", provider=NAME, extra=EXTRA)
            retry = import_sdk("urllib3.util.retry", provider=NAME, extra=EXTRA)
            configuration = kubernetes.client.Configuration()
            try:
                if os.environ.get("KUBERNETES_SERVICE_HOST") and not (
                        os.environ.get("KUBECONFIG") or Path("~/.kube/config").expanduser().exists()):
                    kubernetes.config.load_incluster_config(client_configuration=configuration)
                    self._namespace = self._namespace or Path(
                        "/var/run/secrets/kubernetes.io/serviceaccount/namespace").read_text().strip()
                else:
                    # The client reads KUBECONFIG once, at import: read it now, where the caller set it.
                    path = os.environ.get("KUBECONFIG") or None
                    kubernetes.config.load_kube_config(path, context=self.context, client_configuration=configuration)
                    contexts, active = kubernetes.config.list_kube_config_contexts(path)
                    chosen = next((c for c in contexts if c["name"] == self.context), active)
                    self.context = chosen["name"]
                    self._namespace = self._namespace or chosen.get("context", {}).get("namespace")
            except (kubernetes.config.ConfigException, OSError) as err:
                raise AuthError(f"no Kubernetes cluster configured ({err}). To fix: set KUBECONFIG or "
                                "TFSN_K8S_CONTEXT to a kubeconfig context of the cluster", provider=NAME) from None
            configuration.retries = retry.Retry(
                total=RETRIES, backoff_factor=BACKOFF_S, status_forcelist=(429, 500, 502, 503, 504),
                allowed_methods=None, raise_on_status=False, respect_retry_after_header=True)
            return kubernetes.client.CoreV1Api(kubernetes.client.ApiClient(configuration))
        return self._clients.get("core", make)

    @property
    def namespace(self) -> str:
        self._core()
        return self._namespace or "default"

    def api_client(self) -> Any:
        """The configured ApiClient (timeouts, retries, credentials), for other APIs of the same cluster."""
        return self._core().api_client

    def read_secret(self, namespace: str, name: str, key: str) -> str | None:
        """One value of a Secret, None when the Secret or the key is missing (ProviderError if unreadable)."""
        import base64
        found = self._call(f"cannot read Secret {name}", "read_namespaced_secret", name, namespace)
        if (found.data or {}).get(key):
            return base64.b64decode(found.data[key]).decode()
        return (found.string_data or {}).get(key) or None

    def _call(self, what: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """One API call with the timeout, its errors turned into provider errors."""
        api = self._core()
        try:
            return getattr(api, method)(*args, _request_timeout=TIMEOUT_S, **kwargs)
        except Exception as err:
            raise _provider_error(err, what, self.namespace) from None

    def _create(self, what: str, method: str, namespace: str, manifest: dict[str, Any]) -> bool:
        """Create an object with a `create_namespaced_*` call; False where one of its name exists already (the
        name is the idempotency key: the caller decides whether it is the same)."""
        kubernetes = import_sdk("kubernetes", provider=NAME, extra=EXTRA)
        try:
            getattr(self._core(), method)(namespace, manifest, _request_timeout=TIMEOUT_S)
        except kubernetes.client.ApiException as err:
            if err.status != 409:
                raise _provider_error(err, what, namespace) from None
            return False
        except Exception as err:
            raise _provider_error(err, what, namespace) from None
        return True

    def offers(self) -> list[Offer]:
        """One offer per GPU model on the cluster's nodes (the largest node of each), plus CPU-only nodes."""
        from providers.catalog import ACCELERATOR_MEMORY_GIB

        nodes = self._call("cannot list the cluster's nodes", "list_node").items
        best: dict[str, Offer] = {}
        for node in nodes:
            if node.spec and node.spec.unschedulable:
                continue
            labels = node.metadata.labels or {}
            allocatable = (node.status.allocatable if node.status else None) or {}
            gpus = int(_quantity(allocatable.get(GPU, "0")))
            key = next((k for k in GPU_LABELS if labels.get(k)), None)
            price = _price(node)
            if gpus and key:
                product = labels[key]
                selector, accelerator = f"{key}={product}", canonical_accelerator(product)
                memory_gib = (float(labels[GPU_MEMORY_LABEL]) / 1024 if labels.get(GPU_MEMORY_LABEL)
                              else float(ACCELERATOR_MEMORY_GIB.get(accelerator.upper(), 0.0)))
            else:
                selector, accelerator, memory_gib, gpus = CPU_INSTANCE, None, 0.0, 0
            candidate = Offer(provider=NAME, region=self.context or "in-cluster", zone=None, instance_type=selector,
                              accelerator=accelerator, accelerator_count=gpus, accelerator_memory_gib=memory_gib,
                              vcpus=_quantity(allocatable.get("cpu", "0")),
                              memory_gib=_quantity(allocatable.get("memory", "0")) / 2**30, price=price)
            current = best.get(selector)
            if current is None or (candidate.accelerator_count, candidate.vcpus) > (current.accelerator_count,
                                                                                     current.vcpus):
                best[selector] = candidate
        return sorted(best.values(), key=lambda o: o.instance_type)

    def pod(self, request: NodeRequest) -> dict[str, Any]:
        """The pod manifest of a node."""
        offer = request.offer
        limits: dict[str, str] = {}
        requests: dict[str, str] = {}
        if request.cpus:
            requests["cpu"] = str(request.cpus)
        if request.memory_gib:
            requests["memory"] = f"{int(request.memory_gib * 1024)}Mi"
        spec: dict[str, Any] = {"restartPolicy": "Never", "terminationGracePeriodSeconds": DELETE_GRACE_S}
        if offer is not None and offer.instance_type != CPU_INSTANCE:
            key, _, value = offer.instance_type.partition("=")
            spec["nodeSelector"] = {key: value}
        if offer is not None and offer.accelerator_count:
            limits[GPU] = str(offer.accelerator_count)
            spec["tolerations"] = [{"key": GPU, "operator": "Exists", "effect": "NoSchedule"}]
        placement = request.placement
        if placement.get("node_selector"):      # the job's own node labels, on top of the GPU's
            spec["nodeSelector"] = {**spec.get("nodeSelector", {}), **placement["node_selector"]}
        if placement.get("tolerations"):
            spec["tolerations"] = spec.get("tolerations", []) + [dict(t) for t in placement["tolerations"]]
        if request.avoid_hosts:   # machines the health policy took out of this job
            spec["affinity"] = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": [
                    {"key": "kubernetes.io/hostname", "operator": "NotIn", "values": list(request.avoid_hosts)}]}]}}}
        name = dns_label(request.node_id)
        binding = self.bindings.get(request.job_id)
        container: dict[str, Any] = {
            "name": "agent",
            "image": (binding and binding.image) or placement.get("image") or os.environ.get("TFSN_K8S_IMAGE")
            or DEFAULT_IMAGE,
            "command": ENTRYPOINT + list((binding and binding.command) or request.command),
            "env": [{"name": k, "value": v} for k, v in sorted(request.env.items())],
            "resources": {k: v for k, v in (("limits", limits), ("requests", requests)) if v},
        }
        if os.path.isabs(request.workdir):   # a relative one means the image's own working directory
            container["workingDir"] = request.workdir
        metadata: dict[str, Any] = {
            "name": name,
            "labels": {**node_tags(request, label_safe=True), "app.kubernetes.io/managed-by": "tfsn"},
            "annotations": {NODE_ANNOTATION: request.node_id, JOB_ANNOTATION: request.job_id}}
        if binding is not None:
            _bind(binding, metadata, spec, container, name, request.env)
        # the agent reports the Kubernetes node it runs on: what the health policy excludes when it replaces it
        container["env"].append({"name": "TFSN_HOST_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}})
        spec["containers"] = [container]
        return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": spec}

    def provision(self, request: NodeRequest) -> NodeHandle:
        if request.offer is not None and request.offer.provider != NAME:
            raise InvalidRequestError(f"kubernetes node {request.node_id}: the offer is of {request.offer.provider}. "
                                      "To fix: plan the job on an offer of the kubernetes provider", provider=NAME)
        if request.spot:
            raise InvalidRequestError("a Kubernetes cluster has no spot market. To fix: set use_spot: false",
                                      provider=NAME)
        manifest = self.pod(request)
        name = manifest["metadata"]["name"]
        binding = self.bindings.get(request.job_id)
        namespace = binding.namespace if binding is not None else self.namespace
        what = f"cannot create pod {name} in namespace {namespace}"
        if binding is not None and "TFSN_TOKEN" in request.env:   # the pod reads its token from there
            self.replace_secret_data(namespace, binding.token_secret,
                                     {AGENT_KEY.format(node_id=request.node_id): request.env["TFSN_TOKEN"]})
        if not self._create(what, "create_namespaced_pod", namespace, manifest):
            # Idempotent: the pod exists. It is this node's if it carries this node id.
            existing = self._call(what, "read_namespaced_pod", name, namespace)
            if (existing.metadata.annotations or {}).get(NODE_ANNOTATION) != request.node_id:
                raise InvalidRequestError(f"{what}: a pod of that name belongs to something else. To fix: delete "
                                          "it or use another namespace (TFSN_K8S_NAMESPACE)", provider=NAME)
        return NodeHandle(provider=NAME, node_id=request.node_id,
                          data={"namespace": namespace, "pod": name, "context": self.context})

    def _where(self, handle: NodeHandle) -> tuple[str, str]:
        return handle.data.get("pod") or dns_label(handle.node_id), handle.data.get("namespace") or self.namespace

    def status(self, handle: NodeHandle) -> NodeStatus:
        name, namespace = self._where(handle)
        try:
            pod = self._call(f"cannot read pod {name}", "read_namespaced_pod", name, namespace)
        except NotFoundError:
            return NodeStatus.TERMINATED
        except ProviderError:
            return NodeStatus.UNKNOWN
        self._remember_host(handle, pod)
        if pod.metadata.deletion_timestamp:
            return NodeStatus.TERMINATED
        return PHASES.get(pod.status.phase if pod.status else None, NodeStatus.PENDING)

    def terminate(self, handle: NodeHandle) -> None:
        name, namespace = self._where(handle)
        try:
            pod = self._call(f"cannot delete pod {name}", "delete_namespaced_pod", name, namespace,
                             grace_period_seconds=DELETE_GRACE_S, propagation_policy="Background")
        except NotFoundError:
            return
        self._remember_host(handle, pod)
        if self.on_deleted is not None and handle.node_id in self.hosts:
            self.on_deleted(handle.node_id, self.hosts[handle.node_id])

    # -- what `tfsn down` finds and deletes (providers.sweep) ------------------------------------

    def tagged_resources(self) -> list[TaggedResource]:
        """The namespace's pods labelled with a tfsn job, but those a TfsnJob owns (its operator keeps them, and
        deleting the TfsnJob deletes them)."""
        try:
            namespace = self.namespace
        except AuthError as err:   # no kubeconfig and not in a cluster
            raise NotConfigured(str(err), provider=NAME) from None
        pods = self._call(f"cannot list pods in namespace {namespace}", "list_namespaced_pod", namespace,
                          label_selector=JOB_TAG).items
        found = []
        for pod in pods:
            labels, notes = pod.metadata.labels or {}, pod.metadata.annotations or {}
            if JOB_TAG in labels and not pod.metadata.owner_references:   # exact ids: a label value may be shortened
                found.append(tagged(NAME, "pod", pod.metadata.name, namespace, {
                    JOB_TAG: notes.get(JOB_ANNOTATION, labels[JOB_TAG]),
                    NODE_TAG: notes.get(NODE_ANNOTATION, labels.get(NODE_TAG)), OWNER_TAG: labels.get(OWNER_TAG)}))
        return found

    def delete_resource(self, resource: TaggedResource) -> None:
        """Delete the pod: once the API server took the deletion, its kubelet stops it within DELETE_GRACE_S."""
        self.terminate(NodeHandle(NAME, resource.node or resource.name,
                                  {"pod": resource.name, "namespace": resource.where}))

    def _remember_host(self, handle: NodeHandle, pod: Any) -> None:
        """Where the pod ran: a node failed for a bad GPU is tainted after its pod is gone."""
        host = getattr(getattr(pod, "spec", None), "node_name", None)
        if host:
            self.hosts[handle.node_id] = host

    # ---- what the operator needs besides pods ---------------------------------------------------
    def apply(self, kind: str, namespace: str, manifest: dict[str, Any]) -> None:
        """Create a Service or Secret; one that exists already is left as it is (idempotent)."""
        method = {"Service": "create_namespaced_service", "Secret": "create_namespaced_secret"}[kind]
        self._create(f"cannot create {kind} {manifest['metadata']['name']} in namespace {namespace}", method,
                     namespace, manifest)

    def replace_secret_data(self, namespace: str, name: str, data: dict[str, str]) -> None:
        """Point an existing Secret at new values (a job adopted by a new operator gets a new token)."""
        self._call(f"cannot update Secret {name} in namespace {namespace}", "patch_namespaced_secret",
                   name, namespace, {"stringData": data})

    def pods_of(self, namespace: str, owner_uid: str) -> list[str]:
        """The names of tfsn's pods in `namespace` owned by the object with `owner_uid`."""
        pods = self._call(f"cannot list pods in namespace {namespace}", "list_namespaced_pod", namespace,
                          label_selector="app.kubernetes.io/managed-by=tfsn").items
        return [p.metadata.name for p in pods
                if any(ref.uid == owner_uid for ref in (p.metadata.owner_references or []))]

    def delete_pod(self, namespace: str, name: str) -> None:
        self.terminate(NodeHandle(NAME, name, {"pod": name, "namespace": namespace}))

    def taint(self, host: str, reason: str) -> bool:
        """Keep the scheduler off Kubernetes node `host` (UNHEALTHY_TAINT:NoSchedule); False if it was already."""
        node = self._call(f"cannot read node {host}", "read_node", host)
        taints = [{k: v for k, v in (("key", t.key), ("value", t.value), ("effect", t.effect)) if v is not None}
                  for t in ((node.spec.taints if node.spec else None) or [])]
        if any(t["key"] == UNHEALTHY_TAINT for t in taints):
            return False
        taint = {"key": UNHEALTHY_TAINT, "value": "true", "effect": "NoSchedule"}
        self._call(f"cannot taint node {host}", "patch_node", host, {
            "metadata": {"annotations": {UNHEALTHY_TAINT + "-reason": " ".join(reason.split())[:1000]}},
            "spec": {"taints": taints + [taint]}})
        return True


def _bind(binding: PodBinding, metadata: dict[str, Any], spec: dict[str, Any], container: dict[str, Any],
          name: str, env: dict[str, str]) -> None:
    """Apply a job's PodBinding to its pod manifest (see PodBinding)."""
    metadata["namespace"] = binding.namespace
    metadata["labels"].update(binding.labels or {})
    metadata["ownerReferences"] = [{**binding.owner, "controller": True, "blockOwnerDeletion": True}]
    spec["hostname"], spec["subdomain"] = name, binding.service
    # Only the agent's own settings: the operator's environment (its PATH, its cluster address) is not the pod's.
    token = {"secretKeyRef": {"name": binding.token_secret, "key": AGENT_KEY.format(node_id=env.get("TFSN_NODE_ID"))}}
    container["env"] = [{"name": k, "valueFrom": token} if k == "TFSN_TOKEN" else {"name": k, "value": v}
                        for k, v in sorted(env.items()) if k.startswith("TFSN_")]
    volume: dict[str, Any] = {"name": "checkpoints"}
    if binding.checkpoint_claim:
        volume["persistentVolumeClaim"] = {"claimName": binding.checkpoint_claim}
    else:
        volume["emptyDir"] = {}
    spec["volumes"] = [volume]
    mount = {"name": "checkpoints", "mountPath": binding.checkpoint_path}
    if binding.checkpoint_sub_path:
        mount["subPath"] = binding.checkpoint_sub_path
    container["volumeMounts"] = [mount]


def _classify(err: Exception, *, namespace: str) -> tuple[Fault, str]:
    """The fault of a kubernetes client exception, and the API's status and reason."""
    kubernetes = import_sdk("kubernetes", provider=NAME, extra=EXTRA)
    if not isinstance(err, kubernetes.client.ApiException):
        return (Fault(ProviderError, "check the cluster's address in the kubeconfig and the network", retryable=True),
                f"cannot reach the Kubernetes API ({type(err).__name__}: {err})")
    reason = _reason(err)
    detail = f"{err.status} {reason}"
    if err.status == 401:
        return Fault(AuthError, "refresh the kubeconfig's credentials"), detail
    if err.status == 403 and "exceeded quota" in reason:
        return Fault(QuotaError, f"raise the ResourceQuota of namespace {namespace}"), detail
    if err.status == 403:
        return Fault(AuthError, "grant the kubeconfig's user get/create/delete on pods and list on nodes in "
                                f"namespace {namespace} (a Role and RoleBinding)"), detail
    if err.status == 404:
        return Fault(NotFoundError, f"create namespace {namespace} or set TFSN_K8S_NAMESPACE", "provider"), detail
    if err.status in (400, 422):
        return Fault(InvalidRequestError, "check TFSN_K8S_IMAGE and the offer"), detail
    return Fault(retryable=err.status in (429, 500, 502, 503, 504)), detail


def _provider_error(err: Exception, what: str, namespace: str) -> ProviderError:
    return provider_error(err, what, _classify, provider=NAME, namespace=namespace)


def _reason(err: Any) -> str:
    """The API server's message of an ApiException (its Status body), else the HTTP reason."""
    import json

    try:
        body = json.loads(err.body or "{}")
        body = body if isinstance(body, dict) else {}
        text = f"{body.get('reason', err.reason)}: {body.get('message', '')}".rstrip(": ")
    except ValueError:
        text = str(err.reason)
    return " ".join(text.split())  # one line
