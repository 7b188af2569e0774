"""Checkpoints on gs:// through the real gcsfs and DCP's FsspecWriter/Reader, against gcp-storage-emulator over HTTP.

gcsfs finds the emulator as a user's tools do (STORAGE_EMULATOR_HOST) and, with no Google credentials on the
machine and NO_GCE_CHECK=true, talks to it anonymously. What a user relies on, as on s3://: resume bit for bit,
keep-N, a half-written checkpoint (shards, no manifest) ignored and then replaced, a corrupted shard refused.
"""
from __future__ import annotations

import warnings

import pytest

pytest.importorskip("gcsfs")
pytest.importorskip("gcp_storage_emulator")

import torch  # noqa: E402

from orchestrator.sdk import checkpoint  # noqa: E402
from orchestrator.sdk.checkpoint import CheckpointError, list_checkpoints, load_tensors, restore, save  # noqa: E402
from tests.emulators.gcs import gcs_server as cloud_storage  # noqa: E402
from tests.test_checkpoint import TOTAL_STEPS, assert_same_state, make_objects, train  # noqa: E402

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
    reference = make_objects(0)
    assert restore(url, reference) is None   # nothing there yet: a fresh start
    train(reference, 0, 4)
    saved = save(url, 4, reference, keep=2)
    assert saved.path == f"{url}/step_000000004" and saved.bytes > 0
    assert "step_000000004/" + checkpoint.MANIFEST in keys(fs, url)
    train(reference, 4, TOTAL_STEPS)

    resumed = make_objects(123, fresh=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        info = restore(url, resumed)
    assert info is not None and info.step == 4 and info.path == saved.path
    train(resumed, 4, TOTAL_STEPS)
    assert_same_state(reference, resumed)

    for step in (5, 6, 7):
        save(url, step, reference, keep=2)
    assert {k.split("/")[0] for k in keys(fs, url)} == {"step_000000006", "step_000000007"}
    assert [i.step for i in list_checkpoints(url)] == [7, 6]
    tensors = load_tensors(f"{url}/step_000000007")
    assert torch.equal(tensors["model.0.weight"], reference["model"].state_dict()["0.weight"])


class _Crash(BaseException):
    """Stands in for the process being killed between the last shard and the manifest."""


def test_half_written_checkpoint_is_ignored_then_replaced_and_a_corrupt_one_refused(bucket, monkeypatch) -> None:
    fs, url = bucket
    model = torch.nn.Linear(4, 4)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(step)
        save(url, step, {"model": model}, keep=5)

    def crash(*args: object) -> None:
        raise _Crash

    with torch.no_grad():
        model.weight.fill_(3)
    with monkeypatch.context() as patched, pytest.raises(_Crash):
        patched.setattr(checkpoint, "_commit", crash)
        save(url, 3, {"model": model}, keep=5)
    written = [k for k in keys(fs, url) if k.startswith("step_000000003/")]
    assert any(k.endswith(".distcp") for k in written) and f"step_000000003/{checkpoint.MANIFEST}" not in written
    fresh = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="step_000000003: manifest missing"):   # no manifest: no checkpoint
        assert restore(url, {"model": fresh}).step == 2
    assert torch.equal(fresh.weight, torch.full((4, 4), 2.0))

    with torch.no_grad():
        model.weight.fill_(30)
    save(url, 3, {"model": model}, keep=5)   # the same step again: the half one is replaced, not mixed in
    assert torch.equal(load_tensors(f"{url}/step_000000003")["model.weight"], torch.full((4, 4), 30.0))

    shard = next(f"{url}/{k}" for k in keys(fs, url) if k.startswith("step_000000003/") and k.endswith(".distcp"))
    data = bytearray(fs.cat_file(shard))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(shard, bytes(data))
    with pytest.raises(CheckpointError, match=r"step_000000003: checksum mismatch in __0_0\.distcp; the checkpoint "
                                              r"is corrupt"):
        load_tensors(f"{url}/step_000000003")
    with pytest.warns(UserWarning, match="step_000000003: checksum mismatch"):
        assert restore(url, {"model": fresh}).step == 2
    assert torch.equal(fresh.weight, torch.full((4, 4), 2.0))


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
