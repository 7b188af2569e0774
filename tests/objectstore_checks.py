"""What a user relies on from checkpoints on any object store (s3://, gs://), each check run against one store's
emulator by its test file. No rename on object storage: the manifest, written last, is the commit.

`keys()` lists the objects under the checkpoint URL, relative to it; `read(key)` and `write(key, data)` reach an
object directly, past tfsn (as a bit flip in the bucket would).
"""
from __future__ import annotations

import warnings
from typing import Callable

import pytest
import torch

from orchestrator.sdk import checkpoint
from orchestrator.sdk.checkpoint import CheckpointError, list_checkpoints, load_tensors, restore, save
from tests.test_checkpoint import TOTAL_STEPS, assert_same_state, make_objects, train

Keys = Callable[[], list[str]]


def resume_is_bit_exact_and_keep_prunes(url: str, keys: Keys) -> None:
    """Fresh start, save, resume bit for bit, keep-2 pruning, the manifest and the tensors readable."""
    reference = make_objects(0)
    assert restore(url, reference) is None   # nothing there yet: a fresh start
    train(reference, 0, 4)
    saved = save(url, 4, reference, keep=2)
    assert saved.path == f"{url}/step_000000004" and saved.bytes > 0
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
    assert {k.split("/")[0] for k in keys()} == {"step_000000006", "step_000000007"}
    assert [i.step for i in list_checkpoints(url)] == [7, 6]
    assert f"step_000000007/{checkpoint.MANIFEST}" in keys()
    tensors = load_tensors(f"{url}/step_000000007")
    assert torch.equal(tensors["model.0.weight"], reference["model"].state_dict()["0.weight"])


def save_two(url: str) -> torch.nn.Linear:
    """Checkpoints at steps 1 and 2 whose weights are filled with 1 and 2."""
    model = torch.nn.Linear(4, 4)
    for step in (1, 2):
        with torch.no_grad():
            model.weight.fill_(step)
        save(url, step, {"model": model}, keep=5)
    return model


class _Crash(BaseException):
    """Stands in for the process being killed between the last shard and the manifest."""


def half_written_is_ignored_then_replaced(url: str, keys: Keys, monkeypatch: pytest.MonkeyPatch) -> None:
    model = save_two(url)

    def crash(*args: object) -> None:
        raise _Crash

    with torch.no_grad():
        model.weight.fill_(3)
    with monkeypatch.context() as patched, pytest.raises(_Crash):   # only this: the store's settings stay
        patched.setattr(checkpoint, "_commit", crash)
        save(url, 3, {"model": model}, keep=5)
    written = [k for k in keys() if k.startswith("step_000000003/")]
    assert any(k.endswith(".distcp") for k in written) and f"step_000000003/{checkpoint.MANIFEST}" not in written

    fresh = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="step_000000003: manifest missing"):   # no manifest: no checkpoint
        assert restore(url, {"model": fresh}).step == 2
    assert torch.equal(fresh.weight, torch.full((4, 4), 2.0))
    assert [i.step for i in list_checkpoints(url)] == [2, 1]

    with torch.no_grad():
        model.weight.fill_(30)
    save(url, 3, {"model": model}, keep=5)   # the same step again: the half one is replaced, not mixed in
    assert torch.equal(load_tensors(f"{url}/step_000000003")["model.weight"], torch.full((4, 4), 30.0))


def corrupted_shard_is_refused(url: str, keys: Keys, read: Callable[[str], bytes],
                               write: Callable[[str, bytes], None]) -> None:
    save_two(url)
    shard = next(k for k in keys() if k.startswith("step_000000002/") and k.endswith(".distcp"))
    data = bytearray(read(shard))
    data[len(data) // 2] ^= 0xFF
    write(shard, bytes(data))

    with pytest.raises(CheckpointError, match=r"step_000000002: checksum mismatch in __0_0\.distcp; the checkpoint "
                                              r"is corrupt"):
        load_tensors(f"{url}/step_000000002")
    fresh = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="step_000000002: checksum mismatch"):
        assert restore(url, {"model": fresh}).step == 1
    assert torch.equal(fresh.weight, torch.full((4, 4), 1.0))
    assert shard in keys()   # restore never deletes


def fsspec_keys(fs, url: str) -> list[str]:
    """The objects under `url`, relative to it, as the store's own fsspec filesystem lists them now."""
    fs.invalidate_cache()
    prefix = url.split("://", 1)[1] + "/"
    return sorted(path[len(prefix):] for path in fs.find(url))


class FsspecStoreChecks:
    """The checks as tests, for a store a test module reaches through its fsspec filesystem: the module gives the
    `store` fixture, (that filesystem, a checkpoint URL of the test's own), and a `Test...` subclass."""

    def test_save_resume_and_keep(self, store) -> None:
        fs, url = store
        resume_is_bit_exact_and_keep_prunes(url, lambda: fsspec_keys(fs, url))

    def test_half_written_checkpoint_is_ignored_then_replaced(self, store, monkeypatch) -> None:
        fs, url = store
        half_written_is_ignored_then_replaced(url, lambda: fsspec_keys(fs, url), monkeypatch)

    def test_corrupted_shard_is_refused(self, store) -> None:
        fs, url = store
        corrupted_shard_is_refused(url, lambda: fsspec_keys(fs, url), lambda key: fs.cat_file(f"{url}/{key}"),
                                   lambda key, data: fs.pipe_file(f"{url}/{key}", data))
