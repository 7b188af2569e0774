"""Checkpoints on gs:// through the real gcsfs and DCP's FsspecWriter/Reader, against gcp-storage-emulator over HTTP.

gcsfs finds the emulator as a user's tools do (STORAGE_EMULATOR_HOST) and, with no Google credentials on the
machine and NO_GCE_CHECK=true, talks to it anonymously. What a user relies on, as on s3://: resume bit for bit,
keep-N, a half-written checkpoint (shards, no manifest) ignored and then replaced, a corrupted shard refused.
"""
from __future__ import annotations

import pytest

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

import torch  # noqa: E402

from orchestrator.sdk import checkpoint  # noqa: E402
from orchestrator.sdk.checkpoint import restore, save  # noqa: E402
from tests.emulators.gcs import gcs_server as cloud_storage  # noqa: E402
from tests.objectstore_checks import FsspecStoreChecks, fsspec_keys  # noqa: E402

BUCKET = "tfsn-ckpt"


def forget_gcs_clients() -> None:
    """Drop the GCS filesystems fsspec keeps per constructor arguments (each holds its day's endpoint)."""
    from gcsfs import GCSFileSystem
    GCSFileSystem.clear_instance_cache()


@pytest.fixture(scope="module")
def gcs_server():
    with cloud_storage(BUCKET) as url:
        yield url
    forget_gcs_clients()


@pytest.fixture
def store(gcs_server, monkeypatch, tmp_path, request):
    """The emulator's bucket, reached only through STORAGE_EMULATOR_HOST; no Google credentials anywhere; a
    prefix of its own per test. Yields (a gcsfs filesystem to look at the bucket directly, the prefix's URL)."""
    for name in ("GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "GCSFS_DEFAULT_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in {"STORAGE_EMULATOR_HOST": gcs_server, "NO_GCE_CHECK": "true",
                        "CLOUDSDK_CONFIG": str(tmp_path / "gcloud")}.items():
        monkeypatch.setenv(name, value)
    forget_gcs_clients()
    import gcsfs
    prefix = f"{BUCKET}/{request.node.name}"
    yield gcsfs.GCSFileSystem(), f"gs://{prefix}"
    forget_gcs_clients()


class TestCheckpointsOnGcs(FsspecStoreChecks):
    """Resume bit for bit, keep-N, a half-written save skipped, a corrupt shard refused."""


def test_a_scheme_in_capitals_is_the_same_store(store) -> None:
    """URL schemes are case-insensitive (validate takes GS:// as an object store), fsspec's registry is not: the store
    is the same one, not 'Protocol not known: GS' at the job's first save on the cloud."""
    fs, url = store
    model = torch.nn.Linear(4, 4)
    saved = save(url.replace("gs://", "GS://"), 1, {"model": model})
    assert saved.path == f"{url}/step_000000001" and f"step_000000001/{checkpoint.MANIFEST}" in fsspec_keys(fs, url)
    fresh = torch.nn.Linear(4, 4)
    assert restore(url.replace("gs://", "Gs://"), {"model": fresh}).step == 1
    assert torch.equal(fresh.weight, model.weight)
