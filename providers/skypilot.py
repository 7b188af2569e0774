"""The SkyPilot provider: a node is a one-node SkyPilot cluster, for clouds tfsn has no driver of its own.

An offer of this provider names its cloud in the region, SkyPilot's `infra` form
("lambda/us-east-1"), so the planner ranks it like any other offer and this driver hands exactly
that choice (cloud, region, zone, instance type, market) to `sky.launch`. SkyPilot does the rest:
credentials from its own `sky check` setup, provisioning, setup and run. The cluster is launched
with `down=True`, so it is torn down when the agent exits and a lost controller leaks nothing.
"""
from __future__ import annotations

import shlex
from dataclasses import replace
from pathlib import Path
from typing import Any

from providers.base import (AuthError, CapacityError, Fault, InvalidRequestError, NodeHandle, NodeRequest, NodeStatus,
                            Offer, ProviderError, import_sdk, provider_error)
from providers.bootstrap import INSTALL_SPEC_ENV, install_command
from providers.naming import dns_label, node_tags

NAME = "skypilot"
EXTRA = "skypilot"
CLUSTER_PREFIX = "tfsn-"
SKY_CATALOGS = Path("~/.sky/catalogs")  # SkyPilot's catalog cache: <version>/<cloud>/vms.csv
OWN_DRIVERS = {"aws", "gcp", "azure", "kubernetes"}  # clouds tfsn reaches through their own SDKs
STATES = {"INIT": NodeStatus.PENDING, "PENDING": NodeStatus.PENDING, "UP": NodeStatus.RUNNING,
          "AUTOSTOPPING": NodeStatus.TERMINATED, "STOPPED": NodeStatus.TERMINATED}


def _sky() -> Any:
    return import_sdk("sky", provider=NAME, extra=EXTRA)


def cluster_name(node_id: str) -> str:
    """SkyPilot's cluster name of a node: starts with a letter, lowercase, '-' only."""
    return dns_label(CLUSTER_PREFIX + node_id)


def task(request: NodeRequest) -> Any:
    """The `sky.Task` of a node: install tfsn if the image lacks it, then run the agent command."""
    sky = _sky()
    offer = request.offer
    if offer is None or offer.provider != NAME or "/" not in offer.region:
        raise InvalidRequestError(f"skypilot node {request.node_id}: the request has no SkyPilot offer (region "
                                  "'<cloud>/<region>'). To fix: plan the job on an offer of the skypilot catalog",
                                  provider=NAME)
    if request.spot and offer.spot_price is None:
        raise InvalidRequestError(f"{offer.instance_type} in {offer.region} has no spot market. To fix: set "
                                  "use_spot: false or pick another offer", provider=NAME)
    try:
        resources = sky.Resources(
            infra="/".join(part for part in (offer.region, offer.zone) if part),
            instance_type=offer.instance_type, use_spot=request.spot,
            labels=node_tags(request, label_safe=True))
        resources.validate()
    except ValueError as err:  # SkyPilot checks the cloud, region, zone and instance type against its catalog
        raise InvalidRequestError(f"SkyPilot refuses {offer.instance_type} in {offer.region}: {err}. To fix: "
                                  "refresh the catalog or pick another offer", provider=NAME) from None
    node_task = sky.Task(
        name=cluster_name(request.node_id),
        setup=install_command(request.env.get(INSTALL_SPEC_ENV)),
        run=f"mkdir -p {shlex.quote(request.workdir)} && cd {shlex.quote(request.workdir)} && "
            + " ".join(shlex.quote(part) for part in request.command),
        envs=dict(request.env))
    node_task.set_resources(resources)
    return node_task


def _classify(err: Exception, *, zone: str | None) -> tuple[Fault, str]:
    """The fault of a SkyPilot exception, and SkyPilot's own message."""
    exc = import_sdk("sky.exceptions", provider=NAME, extra=EXTRA)
    message = " ".join(str(err).split())
    if isinstance(err, exc.ResourcesUnavailableError):
        if err.no_failover:
            return Fault(InvalidRequestError, "pick another offer"), message
        return Fault(CapacityError, "try another zone or instance type, or wait", "zone" if zone else "region"), message
    if isinstance(err, exc.NoCloudAccessError | exc.CloudUserIdentityError | exc.PermissionDeniedError):
        return (Fault(AuthError, "set up the cloud's credentials and run `sky check`"),
                f"{type(err).__name__}: {message}")
    if isinstance(err, exc.ResourcesMismatchError | exc.NotSupportedError):
        return Fault(InvalidRequestError, "pick another offer"), message
    transient = isinstance(err, exc.ApiServerConnectionError | exc.NetworkError | exc.ServerTemporarilyUnavailableError)
    return Fault(retryable=transient), f"{type(err).__name__}: {message}"


def _provider_error(err: Exception, what: str, zone: str | None) -> ProviderError:
    return provider_error(err, what, _classify, provider=NAME, zone=zone)


class SkyPilotProvider:
    """One-node SkyPilot clusters as nodes (see the module docstring)."""

    name = NAME

    def offers(self) -> list[Offer]:
        """The offers of SkyPilot's local catalogs (`~/.sky/catalogs`) for every cloud tfsn has no driver
        of its own, each region written as SkyPilot's infra, "<cloud>/<region>"."""
        from providers.catalog import read_offers, skypilot_catalog

        clouds = {path.parent.name for path in SKY_CATALOGS.expanduser().glob("*/*/vms.csv")} - OWN_DRIVERS
        return [replace(offer, region=f"{cloud}/{offer.region}")
                for cloud in sorted(clouds) for offer in read_offers(skypilot_catalog(cloud), provider=NAME)]

    def provision(self, request: NodeRequest) -> NodeHandle:
        """Launch the cluster and wait for SkyPilot to have it up (SkyPilot's launch is one blocking request:
        only its end says whether the cloud had capacity, which the planner needs for failover)."""
        sky = _sky()
        node_task = task(request)
        name = cluster_name(request.node_id)
        what = f"cannot launch {request.offer.instance_type} in {request.offer.region} for node {request.node_id}"
        handle = NodeHandle(provider=NAME, node_id=request.node_id,
                            data={"cluster": name, "infra": request.offer.region, "zone": request.offer.zone})
        # Idempotent: launching onto an existing cluster would run a second agent on it.
        if self.status(handle) in (NodeStatus.PENDING, NodeStatus.RUNNING):
            return handle
        try:
            sky.get(sky.launch(node_task, cluster_name=name, down=True))
        except Exception as err:
            raise _provider_error(err, what, request.offer.zone) from None
        return handle

    def status(self, handle: NodeHandle) -> NodeStatus:
        sky = _sky()
        name = handle.data.get("cluster") or cluster_name(handle.node_id)
        try:
            records = sky.get(sky.status(cluster_names=[name]))
        except Exception:
            return NodeStatus.UNKNOWN
        if not records:
            return NodeStatus.TERMINATED
        record = records[0]
        state = record["status"] if isinstance(record, dict) else record.status
        return STATES.get(getattr(state, "value", state), NodeStatus.UNKNOWN)

    def terminate(self, handle: NodeHandle) -> None:
        sky = _sky()
        exc = import_sdk("sky.exceptions", provider=NAME, extra=EXTRA)
        name = handle.data.get("cluster") or cluster_name(handle.node_id)
        try:
            sky.get(sky.down(name))
        except exc.ClusterDoesNotExist:
            return
        except Exception as err:
            raise _provider_error(err, f"cannot tear down cluster {name} of node {handle.node_id}", None) from None
