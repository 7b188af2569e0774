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
from tests.objectstore_checks import (corrupted_shard_is_refused, half_written_is_ignored_then_replaced,  # noqa: E402
                                      resume_is_bit_exact_and_keep_prunes)

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
def bucket(gcs_server, monkeypatch, tmp_path, request):
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


def keys(fs, url: str) -> list[str]:
    """The objects under `url`, relative to it."""
    fs.invalidate_cache()
    prefix = url.removeprefix("gs://") + "/"
    return sorted(path[len(prefix):] for path in fs.find(url))


def test_save_resume_and_keep_on_gcs(bucket) -> None:
    fs, url = bucket
    resume_is_bit_exact_and_keep_prunes(url, lambda: keys(fs, url))


def test_half_written_checkpoint_is_ignored_then_replaced(bucket, monkeypatch) -> None:
    fs, url = bucket
    half_written_is_ignored_then_replaced(url, lambda: keys(fs, url), monkeypatch)


def test_corrupted_shard_is_refused(bucket) -> None:
    fs, url = bucket
    corrupted_shard_is_refused(url, lambda: keys(fs, url), lambda key: fs.cat_file(f"{url}/{key}"),
                               lambda key, data: fs.pipe_file(f"{url}/{key}", data))


def test_a_scheme_in_capitals_is_the_same_store(bucket) -> None:
    """URL schemes are case-insensitive (validate takes GS:// as an object store), fsspec's registry is not: the store
    is the same one, not 'Protocol not known: GS' at the job's first save on the cloud."""
    fs, url = bucket
    model = torch.nn.Linear(4, 4)
    saved = save(url.replace("gs://", "GS://"), 1, {"model": model})
    assert saved.path == f"{url}/step_000000001" and f"step_000000001/{checkpoint.MANIFEST}" in keys(fs, url)
    fresh = torch.nn.Linear(4, 4)
    assert restore(url.replace("gs://", "Gs://"), {"model": fresh}).step == 1
    assert torch.equal(fresh.weight, model.weight)
