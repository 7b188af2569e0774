"""Checkpoints on s3:// through the real s3fs and DCP's FsspecWriter/Reader, against moto's S3 server over HTTP.

No rename on object storage: the manifest, written last, is the commit. These tests check what a user relies
on: resume bit for bit, keep-N, a half-written checkpoint ignored, a corrupted shard refused.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from typing import Callable

import pytest

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")

import boto3  # noqa: E402

from orchestrator.sdk import checkpoint, ckptstore  # noqa: E402
from orchestrator.sdk.checkpoint import CheckpointError, list_checkpoints, restore  # noqa: E402
from tests.awsfaults import forget_s3_clients, moto_server  # noqa: E402
from tests.conftest import EXAMPLE, FAST_MODEL  # noqa: E402
from tests.objectstore_checks import (corrupted_shard_is_refused, half_written_is_ignored_then_replaced,  # noqa: E402
                                      resume_is_bit_exact_and_keep_prunes)
from tests.test_checkpoint import (  # noqa: E402
    RESAVE_DEATHS, check_a_resave_that_dies, make_objects)

BUCKET = "tfsn-ckpt"


@pytest.fixture(scope="module")
def s3_server():
    with moto_server() as port:
        yield f"http://127.0.0.1:{port}"


@pytest.fixture
def bucket(s3_server, monkeypatch, tmp_path, request):
    """A fresh bucket reached only through AWS_ENDPOINT_URL (as s3fs/botocore read it), fake credentials."""
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_ENDPOINT_URL": s3_server, "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    forget_s3_clients()   # none made with another test's credentials (or none: see the no-credentials test)
    s3 = boto3.client("s3")
    name = f"{BUCKET}-{re.sub(r'[^a-z0-9]', '-', request.node.name.lower())}"[:63].rstrip("-")
    s3.create_bucket(Bucket=name)
    return s3, name


def keys(s3, bucket: str) -> list[str]:
    return sorted(o["Key"] for o in s3.list_objects_v2(Bucket=bucket).get("Contents", []))


def on(s3, name: str) -> tuple[str, Callable[[], list[str]]]:
    """The checkpoint URL of the bucket's `run/` prefix, and its objects' keys relative to it."""
    return f"s3://{name}/run", lambda: [k.removeprefix("run/") for k in keys(s3, name) if k.startswith("run/")]


def test_save_resume_and_keep_on_s3(bucket) -> None:
    resume_is_bit_exact_and_keep_prunes(*on(*bucket))


def test_half_written_checkpoint_is_ignored_then_replaced(bucket, monkeypatch) -> None:
    half_written_is_ignored_then_replaced(*on(*bucket), monkeypatch)


def test_corrupted_shard_is_refused(bucket) -> None:
    s3, name = bucket
    corrupted_shard_is_refused(*on(s3, name), lambda key: s3.get_object(Bucket=name, Key=f"run/{key}")["Body"].read(),
                               lambda key, data: s3.put_object(Bucket=name, Key=f"run/{key}", Body=data))


def test_example_trains_to_s3_in_the_background_and_resumes(bucket) -> None:
    """The example as a user runs it, checkpointing to s3:// asynchronously (the SDK's default)."""
    _, name = bucket
    url = f"s3://{name}/tiny"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TFSN_")}
    env.update(FAST_MODEL, OMP_NUM_THREADS="1", TFSN_CHECKPOINT_DIR=url, TFSN_CHECKPOINT_INTERVAL="5")

    def run(steps: int) -> str:
        proc = subprocess.run([sys.executable, "train.py"], cwd=EXAMPLE, env={**env, "STEPS": str(steps)},
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    run(10)
    assert [c.step for c in list_checkpoints(url)] == [10, 5]   # the last save was waited for at the end
    assert "starting at step 10 of 12" in run(12)
    assert [c.step for c in list_checkpoints(url)] == [12, 10, 5]


def test_missing_driver_names_the_extra() -> None:
    """Without tfsn[aws] (s3fs), an s3:// directory is one line naming the extra, not an ImportError."""
    code = ("import sys; sys.modules['s3fs'] = None\n"   # as if s3fs was not installed
            "import torch\nfrom orchestrator.sdk.checkpoint import CheckpointError, restore\n"
            "try:\n    restore('s3://tfsn-x/run', {'model': torch.nn.Linear(2, 2)})\n"
            "except CheckpointError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert re.fullmatch(r"checkpoint\.dir s3://tfsn-x/run: s3:// needs a driver that is not installed \(.*\)\. "
                        r"To fix: pip install 'tfsn\[aws\]'\n", out.stdout), out.stdout + out.stderr


def test_a_node_without_credentials_for_the_bucket_is_told_which_field_gives_them(s3_server, monkeypatch, tmp_path):
    """No credentials anywhere (a VM started without resources.remote_identity): the restore fails with one line
    that names the bucket, botocore's reason and the field that gives a node credentials, not 'mounted'."""
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"AWS_ENDPOINT_URL": s3_server, "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none"),
                        "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    forget_s3_clients()   # none made with the other tests' credentials
    with pytest.raises(CheckpointError) as caught:
        restore(f"s3://{BUCKET}-nocreds/run", make_objects(0))
    assert "credentials" in str(caught.value).lower().replace("check that this node has credentials", "")
    message = str(caught.value)
    assert "\n" not in message and f"s3://{BUCKET}-nocreds/run" in message
    assert "resources.remote_identity" in message and "mounted" not in message


@pytest.mark.parametrize("where", RESAVE_DEATHS)
def test_a_resave_on_s3_that_fails_or_dies_keeps_the_committed_step(bucket, monkeypatch, where: str) -> None:
    """Saving a committed step again writes the new copy beside the old one and commits it with the manifest (failed
    before: the old copy was deleted first, so a failure or a kill before the new manifest lost step 3)."""
    s3, name = bucket
    check_a_resave_that_dies(f"s3://{name}/run", ckptstore.ObjectStore, where, monkeypatch)
    listed = json.loads(s3.get_object(Bucket=name, Key=f"run/step_000000003/{checkpoint.MANIFEST}")["Body"].read())
    under = {k.split("/", 2)[2] for k in keys(s3, name) if k.startswith("run/step_000000003/")}
    assert under == set(listed["files"]) | {checkpoint.MANIFEST}   # the older copies are gone
