"""Checkpoints on az:// through the real adlfs (azure-storage-blob) and DCP's FsspecWriter/Reader, against
tests/emulators/blob.py over HTTP.

adlfs finds the emulator as a user's tools find an account (AZURE_STORAGE_CONNECTION_STRING), and tfsn opens az://
with anon=False, as on a VM. What a user relies on, as on s3:// and gs://: resume bit for bit, keep-N, a
half-written checkpoint (shards, no manifest) ignored and then replaced, a corrupted shard refused.
"""
from __future__ import annotations

import pytest

pytest.importorskip("adlfs")

from tests.emulators.blob import BlobEmulator  # noqa: E402
from tests.objectstore_checks import FsspecStoreChecks  # noqa: E402

CONTAINER = "tfsn-ckpt"


def forget_az_clients() -> None:
    """Drop the filesystems fsspec keeps per constructor arguments (each holds its day's account)."""
    from adlfs import AzureBlobFileSystem
    AzureBlobFileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def blob_service():
    with BlobEmulator((CONTAINER,)) as emulator:
        yield emulator
    forget_az_clients()


@pytest.fixture
def store(blob_service, monkeypatch, request):
    """The emulator's container, reached only through AZURE_STORAGE_CONNECTION_STRING; a prefix of its own per test.
    Yields (an adlfs filesystem to look at the container directly, the prefix's URL)."""
    for name in ("AZURE_STORAGE_ACCOUNT_NAME", "AZURE_STORAGE_ACCOUNT_KEY", "AZURE_STORAGE_SAS_TOKEN",
                 "AZURE_STORAGE_ANON", "AZURE_STORAGE_CLIENT_SECRET"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", blob_service.connection_string)
    forget_az_clients()
    import adlfs
    yield adlfs.AzureBlobFileSystem(anon=False), f"az://{CONTAINER}/{request.node.name}"
    forget_az_clients()


class TestCheckpointsOnAz(FsspecStoreChecks):
    """Resume bit for bit, keep-N, a half-written save skipped, a corrupt shard refused."""
