"""The cloud identity a VM runs as (the job spec's `resources.remote_identity`), written once for the three VM drivers.

A node's workers reach the job's bucket with the machine's own short-lived credentials, which the cloud hands to
the VM from its metadata service only when the VM was created with an identity: an IAM instance profile on EC2,
a service account on Compute Engine, a user-assigned managed identity on Azure (SkyPilot's `remote_identity`).
No key is ever put on the node. Each driver attaches the value through its own SDK call; what a value must look
like, and what a cloud's refusal of it means for failover (the whole cloud: every zone would refuse the same
identity) and for the user, are here, so that the spec and the three drivers say the same.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from providers.base import AuthError, Fault, InvalidRequestError

FIELD = "resources.remote_identity"
# The scope a GCE VM's service account is attached with: its IAM roles then say what it may do (Google's advice).
CLOUD_PLATFORM_SCOPE = "https://www.googleapis.com/auth/cloud-platform"

_AWS_NAME = r"[\w+=,.@-]{1,128}"   # IAM's instance profile names
_AWS_ARN = re.compile(rf"arn:aws(?:-cn|-us-gov)?:iam::\d{{12}}:(?P<kind>[\w-]+)/(?:[\w+=,.@-]+/)*{_AWS_NAME}")


@dataclass(frozen=True)
class IdentityKind:
    """One cloud's kind of VM identity: how to recognize a value, how a user makes one, what attaching it needs."""

    what: str           # what the value is, in words
    pattern: re.Pattern[str]
    example: str
    create: str         # how a user makes one
    attach: str         # what the credentials tfsn launches with need to attach it to a VM


KINDS: dict[str, IdentityKind] = {
    "aws": IdentityKind(
        "an IAM instance profile name or ARN", re.compile(rf"{_AWS_NAME}|{_AWS_ARN.pattern}"),
        "tfsn-node or arn:aws:iam::123456789012:instance-profile/tfsn-node",
        "create the instance profile (aws iam create-instance-profile --instance-profile-name NAME; aws iam "
        "add-role-to-instance-profile --instance-profile-name NAME --role-name ROLE)",
        "iam:PassRole on the profile's role"),
    "gcp": IdentityKind(
        "a service account email", re.compile(r"[a-z0-9][a-z0-9._-]*@[a-z0-9][a-z0-9.-]*\.gserviceaccount\.com"),
        "tfsn-node@my-project.iam.gserviceaccount.com",
        "create the service account (gcloud iam service-accounts create NAME) in the project tfsn launches in",
        "roles/iam.serviceAccountUser on that service account"),
    "azure": IdentityKind(
        "a user-assigned managed identity's resource ID", re.compile(
            r"/subscriptions/[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}/resourcegroups/[\w().-]+"
            r"/providers/microsoft\.managedidentity/userassignedidentities/[\w-]+", re.IGNORECASE),
        "/subscriptions/00000000-0000-0000-0000-000000000000/resourceGroups/GROUP/providers/"
        "Microsoft.ManagedIdentity/userAssignedIdentities/tfsn-node",
        "create the identity (az identity create --resource-group GROUP --name NAME)",
        "the Managed Identity Operator role on that identity"),
}


def identity_problem(cloud: str, value: str) -> str | None:
    """What is wrong with `value` as `cloud`'s VM identity, with the fix (one line); None when it is well formed."""
    kind = KINDS[cloud]
    if kind.pattern.fullmatch(value):
        arn = _AWS_ARN.fullmatch(value) if cloud == "aws" else None
        if arn is None or arn["kind"] == "instance-profile":
            return None
        return (f"{value!r} is the ARN of an IAM {arn['kind']}, not of an instance profile (EC2 attaches a role "
                f"through an instance profile). To fix: write the profile's name or its ARN, e.g. {kind.example}")
    return f"{value!r} is not {kind.what}. To fix: write e.g. {kind.example}"


def aws_instance_profile(value: str) -> dict[str, str]:
    """RunInstances' IamInstanceProfile: by ARN or by name, as the user gave it."""
    return {"Arn": value} if value.startswith("arn:") else {"Name": value}


def identity_fault(cloud: str, *, denied: bool) -> Fault:
    """The fault of a VM create that `cloud` refused for its identity: the identity does not exist (or is not of
    the kind the cloud attaches), or the credentials tfsn launches with may not attach it. Either holds in every
    zone and region of the cloud, so the planner fails over to another cloud at once."""
    kind = KINDS[cloud]
    if denied:
        return Fault(AuthError, f"give the credentials tfsn launches with {kind.attach}, or set {FIELD}.{cloud} to "
                                "an identity they may attach", "provider")
    return Fault(InvalidRequestError, f"{kind.create}, or set {FIELD}.{cloud} to {kind.what} that exists",
                 "provider")
