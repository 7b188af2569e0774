"""Checkpoints: bit-exact resume, pruning, corruption fallback, atomicity, and a 2-rank gloo run."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.checkpoint import FileSystemWriter
from torch.nn.parallel import DistributedDataParallel

from orchestrator.sdk import checkpoint, ckptstore
from orchestrator.sdk import run as sdk
from orchestrator.sdk.asyncsave import AsyncSaver
from orchestrator.sdk.checkpoint import CheckpointError, list_checkpoints, load_tensors, restore, save

TOTAL_STEPS = 8


def make_objects(seed: int, *, fresh: bool = False, ddp: bool = False) -> dict[str, object]:
    """Model (with dropout), AdamW and an LR scheduler; RNGs seeded afterwards from ``seed``.

    ``fresh`` stands for a restarted process: other weights until restore overwrites them.
    """
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3), torch.nn.Linear(32, 1)
    )
    if ddp:
        model = DistributedDataParallel(model)
    if fresh:
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=3, gamma=0.5)
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    return {"model": model, "optimizer": optimizer, "scheduler": scheduler}


def train(objects: dict[str, object], start: int, stop: int, rank: int = 0) -> None:
    """Steps ``start..stop-1``; the loss uses torch (dropout), python and numpy randomness."""
    model, optimizer, scheduler = objects["model"], objects["optimizer"], objects["scheduler"]
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * rank + step)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y) * (1 + 0.1 * random.random() + 0.1 * np.random.rand())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        scheduler.step()


def assert_same_state(a: dict[str, object], b: dict[str, object]) -> None:
    def flat(obj: object, prefix: str = "") -> dict[str, object]:
        if isinstance(obj, dict):
            return {k: v for key, val in obj.items() for k, v in flat(val, f"{prefix}{key}.").items()}
        if isinstance(obj, (list, tuple)):
            return {k: v for i, val in enumerate(obj) for k, v in flat(val, f"{prefix}{i}.").items()}
        return {prefix: obj}

    for name in a:
        fa, fb = flat(a[name].state_dict()), flat(b[name].state_dict())
        assert fa.keys() == fb.keys(), name
        for key, va in fa.items():
            if isinstance(va, torch.Tensor):
                assert torch.equal(va, fb[key]), f"{name}: {key}"
            else:
                assert va == fb[key], f"{name}: {key}"


def test_restore_resumes_bit_exact(tmp_path: Path) -> None:
    reference = make_objects(0)
    assert restore(tmp_path, reference) is None  # fresh start
    train(reference, 0, 4)
    saved = save(tmp_path, 4, reference)
    train(reference, 4, TOTAL_STEPS)

    resumed = make_objects(123, fresh=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no DCP noise without a process group
        info = restore(tmp_path, resumed)
    assert info is not None and info.step == 4 and info.path == saved.path
    train(resumed, info.step, TOTAL_STEPS)
    assert_same_state(reference, resumed)

    assert saved.bytes > 0 and saved.seconds > 0
    assert list_checkpoints(tmp_path) == [info]
    tensors = load_tensors(saved.path)
    assert "model.0.weight" in tensors and "optimizer.state.0.weight.exp_avg" in tensors


def test_a_save_whose_storage_draws_random_numbers_leaves_the_training_s_rngs_as_saved(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Storage libraries draw from the process's RNGs as they write (gcsfs's and botocore's retry backoff use
    `random.random()`): the run that saved must go on from the RNG states it saved, or it is not the run a resume
    from that checkpoint replays (seen on gs://: a retried request during the save, and resume was not bit exact)."""
    commit = ckptstore.FolderStore.commit

    def drawing_commit(self, *args: object) -> None:
        random.random(), np.random.rand(), torch.rand(1)   # a retry's jitter, as the library draws it
        commit(self, *args)

    monkeypatch.setattr(ckptstore.FolderStore, "commit", drawing_commit)
    reference = make_objects(0)
    train(reference, 0, 4)
    save(tmp_path, 4, reference)
    train(reference, 4, TOTAL_STEPS)

    resumed = make_objects(123, fresh=True)
    assert restore(tmp_path, resumed).step == 4
    train(resumed, 4, TOTAL_STEPS)
    assert_same_state(reference, resumed)


def test_restore_into_ddp_free_model_and_plain_stateful(tmp_path: Path) -> None:
    class Counter:
        def __init__(self) -> None:
            self.n = 0

        def state_dict(self) -> dict[str, int]:
            return {"n": self.n}

        def load_state_dict(self, state: dict[str, int]) -> None:
            self.n = state["n"]

    model, counter = torch.nn.Linear(3, 2), Counter()
    counter.n = 7
    save(tmp_path, 1, {"model": model, "counter": counter})
    model2, counter2 = torch.nn.Linear(3, 2), Counter()
    assert restore(tmp_path, {"model": model2, "counter": counter2}).step == 1
    assert counter2.n == 7 and torch.equal(model.weight, model2.weight)


def _gan(fresh: bool = False) -> dict[str, object]:
    """A generator and a critic, an Adam each, and an EMA of the generator (an nn.Module of its own)."""
    torch.manual_seed(1 if fresh else 0)
    generator = torch.nn.Linear(4, 4)
    critic = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    ema = torch.optim.swa_utils.AveragedModel(generator, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    return {"generator": generator, "critic": critic, "ema": ema,
            "opt_g": torch.optim.Adam(generator.parameters(), lr=0.1),
            "opt_d": torch.optim.Adam(critic.parameters(), lr=0.1)}


def _train_gan(objects: dict[str, object], start: int, stop: int) -> None:
    generator, critic, ema, opt_g, opt_d = objects.values()
    for step in range(start, stop):
        noise, real = torch.randn(8, 4, generator=torch.Generator().manual_seed(step)).chunk(2)
        opt_d.zero_grad()
        (critic(generator(noise).detach()).mean() - critic(real).mean()).backward()
        opt_d.step()
        opt_g.zero_grad()
        (-critic(generator(noise)).mean()).backward()
        opt_g.step()
        ema.update_parameters(generator)


def test_each_optimizer_is_checkpointed_with_the_module_that_holds_its_parameters(tmp_path: Path) -> None:
    """A GAN's two models with an optimizer each, and an EMA beside the model, resume bit-exact: each optimizer's
    state is keyed by the names of the one module holding all its parameters (refused before: 'optimizers need
    exactly one module among the checkpointed objects, got 3')."""
    reference = _gan()
    _train_gan(reference, 0, 2)
    save(tmp_path / "gan", 2, reference)
    _train_gan(reference, 2, 4)
    resumed = _gan(fresh=True)
    assert restore(tmp_path / "gan", resumed).step == 2
    _train_gan(resumed, 2, 4)
    assert_same_state(reference, resumed)

    a = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(a.parameters(), lr=0.1)
    with pytest.raises(CheckpointError, match="need the model whose parameters they hold"):
        save(tmp_path, 1, {"opt": opt})
    with pytest.raises(CheckpointError, match="'opt''s parameters are held by each of a, net; checkpoint only one"):
        save(tmp_path, 1, {"a": a, "net": torch.nn.Sequential(a), "opt": opt})
    two = {"a": a, "b": torch.nn.Linear(2, 2)}
    nobody = r"no one of the checkpointed modules \(a, b\) holds all of optimizer 'opt''s parameters"
    with pytest.raises(CheckpointError, match=nobody):
        save(tmp_path, 1, {**two, "opt": torch.optim.SGD([*two["a"].parameters(), *two["b"].parameters()], lr=0.1)})


def test_optimizer_of_a_replaced_layer_names_the_problem(tmp_path: Path) -> None:
    """A layer replaced after the optimizer was made: a clear error, at the asynchronous save too, from its wait as
    any failure of an asynchronous save, on every rank alike (failed before: a bare KeyError: 0 from DCP's
    parameter mapping)."""
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    objects = {"model": model, "optimizer": torch.optim.SGD(model.parameters(), lr=0.1)}
    save(tmp_path, 1, objects)
    model[0] = torch.nn.Linear(2, 2)
    message = r"optimizer 'optimizer' holds parameters that are not the model's .*make the optimizer after"
    with pytest.raises(CheckpointError, match=message):
        save(tmp_path, 2, objects)
    saver = AsyncSaver()
    with pytest.raises(CheckpointError, match=message):
        saver.save(tmp_path, 2, objects, keep=3)
        saver.wait()
    saver.close()
    with pytest.raises(CheckpointError, match=message):
        restore(tmp_path, objects)
    assert [i.step for i in list_checkpoints(tmp_path)] == [1]


def test_restore_with_other_objects_names_the_problem(tmp_path: Path) -> None:
    save(tmp_path, 1, {"model": torch.nn.Linear(2, 2)})
    with pytest.raises(CheckpointError, match=r"step_000000001.*Missing key.*other\.weight.*same objects"):
        restore(tmp_path, {"other": torch.nn.Linear(2, 2)})


def _two_layers() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
    return {"model": model, "optimizer": torch.optim.Adam(model.parameters(), lr=0.1)}


def _train_layers(objects: dict[str, object], start: int, stop: int, layers: int = 2) -> None:
    """Steps start..stop-1 through the first `layers` layers: a layer left out has no gradient, so no Adam state."""
    model, optimizer = objects["model"], objects["optimizer"]
    for step in range(start, stop):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
        model[:layers](x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


@pytest.mark.parametrize("how", ["head-not-trained-yet", "state-reset"])
def test_optimizer_state_of_some_parameters_restores_bit_exact(tmp_path: Path, how: str) -> None:
    """Adam creates a parameter's state at its first gradient: a checkpoint may hold it for some parameters, or
    none after the state was reset (read through the learned mapping, not DCP's, which would create it). The
    restored optimizer holds the same, and resumes bit-exact (failed before: 'Missing key in checkpoint
    state_dict: optimizer.state.1.weight.step'; the run could not restart from its newest checkpoint)."""
    reference = _two_layers()
    saver = AsyncSaver()
    if how == "head-not-trained-yet":
        _train_layers(reference, 0, 2, layers=1)
    else:
        _train_layers(reference, 0, 2)
        saver.save(tmp_path, 2, reference, keep=3)   # learns how the optimizer's state maps onto DCP's keys
        reference["optimizer"].state.clear()
    saver.save(tmp_path, 3, reference, keep=3)
    saver.close()
    _train_layers(reference, 3, 6)

    resumed = _two_layers()
    assert restore(tmp_path, resumed).step == 3
    _train_layers(resumed, 3, 6)
    assert_same_state(reference, resumed)


def test_keep_prunes_old_checkpoints(tmp_path: Path) -> None:
    objects = make_objects(0)
    for step in range(1, 6):
        train(objects, step - 1, step)
        save(tmp_path, step, objects, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000004", "step_000000005"]
    assert [i.step for i in list_checkpoints(tmp_path)] == [5, 4]


def test_resaving_same_step_replaces_it(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    save(tmp_path, 3, {"model": model})
    with torch.no_grad():
        model.weight.add_(1)
    save(tmp_path, 3, {"model": model})
    assert [p.name for p in tmp_path.iterdir()] == ["step_000000003"]
    assert torch.equal(load_tensors(tmp_path / "step_000000003")["model.weight"], model.weight)


def _steps_2_and_3_saved(directory: str | Path) -> torch.nn.Linear:
    """Checkpoints 2 and 3 of a model whose weights are 2 and 3; the model returned has weights 30."""
    model = torch.nn.Linear(4, 4)
    for step in (2, 3):
        with torch.no_grad():
            model.weight.fill_(step)
        save(directory, step, {"model": model}, keep=5)
    with torch.no_grad():
        model.weight.fill_(30)
    return model


class _Killer:
    """Stands for `os` or `shutil` in ckptstore: the process is killed (a _Crash) at the `at`-th change to the disk."""

    CHANGES = {"replace", "rename", "remove", "unlink", "rmdir", "fsync", "rmtree"}

    def __init__(self, module: object, at: int, changes: list[int]) -> None:
        self._module, self._at, self._changes = module, at, changes

    def __getattr__(self, name: str) -> object:
        real = getattr(self._module, name)
        if name not in self.CHANGES:
            return real

        def change(*args: object, **kwargs: object) -> object:
            self._changes[0] += 1
            if self._changes[0] == self._at:
                raise _Crash
            return real(*args, **kwargs)

        return change


def test_resaving_a_step_killed_at_any_point_keeps_a_whole_copy_of_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Saving a step that is already committed again (a job restored from it saves it once more) replaces it only
    once the new copy is committed: killed at each change the save makes to the disk in turn, step 3 is there, old
    or new (failed before: the committed copy was moved aside, then the new one renamed in; killed between the two
    renames, step 3 was gone and restore fell back to step 2)."""
    at, killed = 0, True
    while killed:
        at += 1
        directory = tmp_path / str(at)
        model = _steps_2_and_3_saved(directory)
        changes = [0]
        monkeypatch.setattr(ckptstore, "os", _Killer(os, at, changes))
        monkeypatch.setattr(ckptstore, "shutil", _Killer(shutil, at, changes))
        try:
            save(directory, 3, {"model": model}, keep=5)
            killed = False
        except _Crash:
            pass
        monkeypatch.undo()
        fresh = torch.nn.Linear(4, 4)
        assert restore(directory, {"model": fresh}).step == 3, f"killed at change {at}"
        assert fresh.weight.unique().tolist() in ([3.0], [30.0]) and (killed or fresh.weight[0, 0] == 30), at
        assert [i.step for i in list_checkpoints(directory)] == [3, 2]
        save(directory, 3, {"model": model}, keep=5)   # the job goes on: the same step saved once more is the new one
        assert torch.equal(load_tensors(directory / "step_000000003")["model.weight"], torch.full((4, 4), 30.0))
        assert sorted(p.name for p in directory.iterdir()) == ["step_000000002", "step_000000003"]
    assert at > 3   # the kills did land inside the save


class _DiskLog:
    """Stands for `os` in ckptstore: logs the folders it fsyncs and the renames, in order."""

    def __init__(self, log: list[tuple[str, str]]) -> None:
        self._log, self._folders = log, {}

    def __getattr__(self, name: str) -> object:
        return getattr(os, name)

    def open(self, path: object, flags: int, *args: object) -> int:
        fd = os.open(path, flags, *args)
        self._folders[fd] = str(path)
        return fd

    def fsync(self, fd: int) -> None:
        if fd in self._folders:
            self._log.append(("fsync", self._folders[fd]))
        os.fsync(fd)

    def replace(self, source: object, target: object) -> None:
        self._log.append(("replace", str(target)))
        os.replace(source, target)


def test_a_resaved_step_is_durable_before_its_manifest_names_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """In a folder, the new copy's folder is fsynced before the manifest that names it replaces the old one, as a new
    step's folder is before it is renamed in: else a power cut could leave a manifest naming files whose directory
    entries never reached the disk, the older copy already gone (failed before: step_N/data-*/ was never fsynced)."""
    model = _steps_2_and_3_saved(tmp_path)
    log: list[tuple[str, str]] = []
    monkeypatch.setattr(ckptstore, "os", _DiskLog(log))
    save(tmp_path, 3, {"model": model}, keep=5)
    monkeypatch.undo()
    manifest = json.loads((tmp_path / "step_000000003" / checkpoint.MANIFEST).read_text())
    data = str(tmp_path / "step_000000003" / manifest["data"])
    commit = log.index(("replace", str(tmp_path / "step_000000003" / checkpoint.MANIFEST)))
    assert ("fsync", data) in log[:commit], log


def _no_space_writer(store: object, location: object) -> object:
    """A real DCP writer of `store`'s kind whose disk (or bucket) is full."""
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

    folder = isinstance(store, ckptstore.FolderStore)

    class NoSpace(FileSystemWriter if folder else FsspecWriter):   # type: ignore[misc]
        def write_data(self, plan: object, planner: object) -> object:
            raise OSError(28, "No space left on device")

    return NoSpace(location) if folder else NoSpace(str(location), sync_files=False)


def store_that_dies(base: type, where: str) -> type:
    """A store (`base`: FolderStore or ObjectStore) whose save fails at `where` ("writing") or is killed there."""

    class Dying(base):   # type: ignore[misc, valid-type]
        def writer(self, location: object) -> object:
            return _no_space_writer(self, location) if where == "writing" else super().writer(location)

        def commit(self, *args: object) -> None:
            if where == "before the manifest":
                raise _Crash
            super().commit(*args)

        def remove(self, location: object) -> None:
            if where == "after the manifest":
                raise _Crash
            super().remove(location)

    return Dying


RESAVE_DEATHS = ["writing", "before the manifest", "after the manifest"]


def check_a_resave_that_dies(directory: str | Path, base: type, where: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Step 3 saved, then saved again with other weights by a store that fails or is killed at `where`: the
    committed copy is still step 3 until the new one is committed, and the next save of step 3 works."""
    model = _steps_2_and_3_saved(directory)
    monkeypatch.setattr(checkpoint, "open_store", store_that_dies(base, where))
    try:
        save(directory, 3, {"model": model}, keep=5)
    except CheckpointError as e:
        assert where == "writing" and "No space left on device" in str(e)
    except _Crash:
        assert where != "writing"
    monkeypatch.undo()
    fresh = torch.nn.Linear(4, 4)
    assert restore(directory, {"model": fresh}).step == 3
    expected = 30.0 if where == "after the manifest" else 3.0
    assert torch.equal(fresh.weight, torch.full((4, 4), expected))
    assert [i.step for i in list_checkpoints(directory)] == [3, 2]
    with torch.no_grad():
        model.weight.fill_(31)
    save(directory, 3, {"model": model}, keep=5)
    location = f"{directory}/step_000000003" if isinstance(directory, str) else directory / "step_000000003"
    assert torch.equal(load_tensors(location)["model.weight"], torch.full((4, 4), 31.0))


@pytest.mark.parametrize("where", RESAVE_DEATHS)
def test_a_resave_that_fails_or_dies_keeps_the_committed_step(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              where: str) -> None:
    check_a_resave_that_dies(tmp_path, ckptstore.FolderStore, where, monkeypatch)


def _save_three(tmp_path: Path) -> torch.nn.Linear:
    """Checkpoints at steps 1, 2, 3 whose weights are filled with 1, 2, 3."""
    model = torch.nn.Linear(4, 4)
    for step in (1, 2, 3):
        with torch.no_grad():
            model.weight.fill_(step)
        save(tmp_path, step, {"model": model}, keep=5)
    return model


def _flip_bytes(path: Path) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) // 2, len(data) // 2 + 8):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped data bytes": lambda d: _flip_bytes(next(d.glob("*.distcp"))),
    "truncated manifest": lambda d: (d / checkpoint.MANIFEST).write_text((d / checkpoint.MANIFEST).read_text()[:30]),
    "missing manifest": lambda d: (d / checkpoint.MANIFEST).unlink(),
    "missing data file": lambda d: next(d.glob("*.distcp")).unlink(),
    "missing .metadata": lambda d: (d / ".metadata").unlink(),
}


@pytest.mark.parametrize("corruption", list(CORRUPTIONS))
def test_corrupt_latest_falls_back_to_previous(tmp_path: Path, corruption: str) -> None:
    _save_three(tmp_path)
    CORRUPTIONS[corruption](tmp_path / "step_000000003")
    model = torch.nn.Linear(4, 4)
    with pytest.warns(UserWarning, match="step_000000003"):
        info = restore(tmp_path, {"model": model})
    assert info is not None and info.step == 2
    assert torch.equal(model.weight, torch.full((4, 4), 2.0))
    assert [i.step for i in list_checkpoints(tmp_path)] == [2, 1]
    assert (tmp_path / "step_000000003").exists()  # restore never deletes
    with pytest.raises(CheckpointError, match="step_000000003"):
        load_tensors(tmp_path / "step_000000003")


def test_all_corrupt_means_fresh_start(tmp_path: Path) -> None:
    model = torch.nn.Linear(2, 2)
    save(tmp_path, 1, {"model": model})
    (tmp_path / "step_000000001" / checkpoint.MANIFEST).unlink()
    with pytest.warns(UserWarning, match="step_000000001"):
        assert restore(tmp_path, {"model": model}) is None


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_leftover_tmp_dir_is_ignored_then_cleaned(tmp_path: Path) -> None:
    _save_three(tmp_path)
    # A complete-looking DCP write of a newer step whose rename never happened.
    stale = tmp_path / ".tmp-step_000000009-deadbeef"
    torch.distributed.checkpoint.save({"model": {"weight": torch.zeros(4, 4)}}, checkpoint_id=stale, no_dist=True)
    model = torch.nn.Linear(4, 4)
    assert restore(tmp_path, {"model": model}).step == 3
    save(tmp_path, 4, {"model": model}, keep=5)
    assert not list(tmp_path.glob(".tmp-*"))


class _Crash(BaseException):
    """Stands in for the process being killed: nothing in save gets to clean up."""


def test_save_killed_before_rename_leaves_earlier_checkpoints(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save_three(tmp_path)

    def crash(*args: object) -> None:
        raise _Crash

    monkeypatch.setattr(checkpoint, "_commit", crash)
    model = torch.nn.Linear(4, 4)
    with torch.no_grad():
        model.weight.fill_(4)
    with pytest.raises(_Crash):
        save(tmp_path, 4, {"model": model})
    assert len(list(tmp_path.glob(".tmp-step_000000004-*"))) == 1  # DCP files written, never renamed
    monkeypatch.undo()

    fresh = torch.nn.Linear(4, 4)
    assert restore(tmp_path, {"model": fresh}).step == 3
    assert torch.equal(fresh.weight, torch.full((4, 4), 3.0))
    assert [i.step for i in list_checkpoints(tmp_path)] == [3, 2, 1]


def test_failed_save_raises_checkpoint_error_and_cleans_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _save_three(tmp_path)

    class Exploding:
        def state_dict(self) -> dict[str, object]:
            raise RuntimeError("boom")

        def load_state_dict(self, state: dict[str, object]) -> None:
            pass

    model = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="boom"):
        save(tmp_path, 4, {"model": model, "bad": Exploding()})

    def no_disk(path: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckptstore, "_fsync_dir", no_disk)  # fails after the manifest, before the rename
    with pytest.raises(CheckpointError, match="step_000000004.*earlier checkpoints are untouched"):
        save(tmp_path, 4, {"model": model})
    monkeypatch.undo()

    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000000001", "step_000000002", "step_000000003"]
    assert restore(tmp_path, {"model": model}).step == 3


def test_manifest_lists_every_file_with_sha256(tmp_path: Path) -> None:
    info = save(tmp_path, 12, {"model": torch.nn.Linear(2, 2)})
    manifest = json.loads((info.path / checkpoint.MANIFEST).read_text())
    on_disk = {p.name for p in info.path.iterdir()} - {checkpoint.MANIFEST}
    assert manifest["step"] == 12 and manifest["world_size"] == 1 and manifest["format"] == 1
    assert set(manifest["files"]) == on_disk and ".metadata" in on_disk
    assert all(len(h) == 64 for h in manifest["files"].values())


# --- two ranks, gloo ------------------------------------------------------------------------


def _dist_worker(rank: int, world_size: int, init_file: str, ckpt_dir: str, out_dir: str, background: bool) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        reference = make_objects(10 + rank, ddp=True)  # per-rank dropout / python / numpy streams
        assert restore(ckpt_dir, reference) is None
        saver = AsyncSaver() if background else None
        if saver is not None:   # the first save learns DCP's keys (statedicts), the second reads through them
            train(reference, 0, 2, rank)
            saver.save(ckpt_dir, 2, reference, keep=3)
            train(reference, 2, 3, rank)
            saver.save(ckpt_dir, 3, reference, keep=3)   # written by the writer thread while the training goes on
        else:
            train(reference, 0, 3, rank)
            save(ckpt_dir, 3, reference)
        rand_after_save = torch.rand(4)
        train(reference, 3, 6, rank)
        if saver is not None:
            saver.close()

        resumed = make_objects(500 + rank, fresh=True, ddp=True)
        info = restore(ckpt_dir, resumed)
        assert info is not None and info.step == 3
        rand_after_restore = torch.rand(4)
        train(resumed, 3, 6, rank)
        torch.save(
            {
                "rand_after_save": rand_after_save,
                "rand_after_restore": rand_after_restore,
                "reference": {k: v.detach() for k, v in reference["model"].module.state_dict().items()},
                "resumed": {k: v.detach() for k, v in resumed["model"].module.state_dict().items()},
                "optim_reference": reference["optimizer"].state_dict(),
                "optim_resumed": resumed["optimizer"].state_dict(),
            },
            Path(out_dir) / f"rank{rank}.pt",
        )
        # Both ranks done before either tears the group down: a peer closing its sockets while the other
        # still shuts down its gloo threads aborts that process ("terminate called without an active exception").
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_two_ranks_ddp_gloo(tmp_path: Path, background: bool) -> None:
    ckpt_dir, out_dir = tmp_path / "ckpt", tmp_path / "out"
    out_dir.mkdir()
    mp.spawn(_dist_worker, args=(2, str(tmp_path / "init"), str(ckpt_dir), str(out_dir), background), nprocs=2,
             join=True)
    results = [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]

    for r in results:
        assert torch.equal(r["rand_after_save"], r["rand_after_restore"])  # per-rank RNG restored
        for key, value in r["reference"].items():
            assert torch.equal(value, r["resumed"][key]), key
        for pid, state in r["optim_reference"]["state"].items():
            for key, value in state.items():
                assert torch.equal(value, r["optim_resumed"]["state"][pid][key]), (pid, key)
    assert not torch.equal(results[0]["rand_after_save"], results[1]["rand_after_save"])
    for key, value in results[0]["resumed"].items():  # DDP keeps replicas identical
        assert torch.equal(value, results[1]["resumed"][key]), key

    info = list_checkpoints(ckpt_dir)[0]
    manifest = json.loads((info.path / checkpoint.MANIFEST).read_text())
    assert manifest["world_size"] == 2
    assert not list(ckpt_dir.glob(".tmp-*"))
    # Without a process group the checkpoint reads back as plain tensors, without the DDP prefix.
    tensors = load_tensors(info.path)
    assert "model.0.weight" in tensors and not any(k.startswith("model.module.") for k in tensors)


class _Loader:
    """A stateful object (a data loader's position, say) whose state cannot be read on one rank."""

    def __init__(self, broken: bool) -> None:
        self.broken = broken

    def state_dict(self) -> dict[str, object]:
        if self.broken:
            raise RuntimeError("the loader's worker died")
        return {"position": 7}

    def load_state_dict(self, state: dict[str, object]) -> None:
        pass


def _read_only_folder(directory: str | Path) -> ckptstore.FolderStore:
    """This rank's mount of the checkpoint folder is read-only."""

    class ReadOnly(ckptstore.FolderStore):
        def prepare(self, location: object) -> None:
            raise PermissionError(13, "Permission denied", str(location))

    return ReadOnly(directory)


def _save_outcome(save_it: Callable[[], object]) -> dict[str, object]:
    began = time.monotonic()
    try:
        save_it()
        error = None
    except Exception as e:
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "seconds": time.monotonic() - began}


def _failing_rank_worker(rank: int, world_size: int, init_file: str, ckpt_dir: str, out_dir: str) -> None:
    """Saves in which rank 1 fails (its objects' state, its folder), sync and async, then saves that work; then an
    async save still in flight when the script destroys the process group (rank 0 then calls finish, rank 1 exits)."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=30))
    model = torch.nn.Linear(4, 4)
    save(ckpt_dir, 1, {"model": model})
    saver = AsyncSaver()
    outcomes: dict[str, dict[str, object]] = {}
    real_open_store = checkpoint.open_store
    for failure in ("state", "folder"):
        objects = {"model": model, "loader": _Loader(broken=failure == "state" and rank == 1)}
        if failure == "folder" and rank == 1:
            checkpoint.open_store = _read_only_folder
        outcomes[f"sync {failure}"] = _save_outcome(lambda: save(ckpt_dir, 2, objects))
        outcomes[f"async {failure}"] = _save_outcome(lambda: (saver.save(ckpt_dir, 2, objects, keep=3), saver.wait()))
        checkpoint.open_store = real_open_store
    outcomes["left"] = {"steps": [i.step for i in list_checkpoints(ckpt_dir)],
                        "temporary": [p.name for p in Path(ckpt_dir).glob(".tmp-*")]}
    outcomes["sync then"] = _save_outcome(lambda: save(ckpt_dir, 2, {"model": model}))   # the training goes on
    outcomes["async then"] = _save_outcome(lambda: (saver.save(ckpt_dir, 3, {"model": model}, keep=3), saver.wait()))
    saver.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcomes))

    run = sdk.Run(checkpoint_dir=ckpt_dir, checkpoint_interval=1, keep=3, total_steps=5, async_save=True)
    real_commit = checkpoint._commit

    def slow_commit(*args: object) -> object:   # the last save is still being written when the group goes
        time.sleep(1)
        return real_commit(*args)

    for step in run.steps(3):
        with torch.no_grad():
            model.weight.fill_(step + 1)
        if step == 4:
            checkpoint._commit = slow_commit
        run.checkpoint(model=model)
    dist.destroy_process_group()
    if rank == 0:
        run.finish()   # rank 1 leaves the wait for the last save to the exit


@pytest.fixture(scope="module")
def failing_rank_results(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str | None, list[dict[str, dict]]]:
    tmp_path = tmp_path_factory.mktemp("failing-rank")
    ckpt_dir, out_dir = tmp_path / "ckpt", tmp_path / "out"
    out_dir.mkdir()
    try:
        mp.spawn(_failing_rank_worker, args=(2, str(tmp_path / "init"), str(ckpt_dir), str(out_dir)), nprocs=2)
        died = None
    except Exception as e:   # a rank that raised, or exited with a failure
        died = str(e)
    return ckpt_dir, died, [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]


@pytest.mark.timeout(180)
def test_a_save_that_fails_on_one_rank_fails_on_every_rank_at_once(failing_rank_results) -> None:
    """Rank 1 cannot read its objects' state, or cannot write its folder: both ranks hear of it at once, sync or
    async, with a one-line error naming rank 1's problem; the earlier checkpoint stays, and later saves work
    (failed before: rank 1 raised before the save's first collective, and rank 0 waited in it until the process
    group's timeout, 30 s here)."""
    _, _, ranks = failing_rank_results
    assert len(ranks) == 2
    for scenario in ("sync state", "async state", "sync folder", "async folder"):
        cause = "the loader's worker died" if scenario.endswith("state") else "Permission denied"
        for rank, outcomes in enumerate(ranks):
            outcome = outcomes[scenario]
            assert outcome["error"] is not None and outcome["seconds"] < 10, (scenario, rank, outcome)
            assert cause in outcome["error"] and "\n" not in outcome["error"], (scenario, rank, outcome)
        assert ranks[0][scenario]["error"].startswith("CheckpointError: ") and "rank 1" in ranks[0][scenario]["error"]
    assert ranks[0]["left"] == {"steps": [1], "temporary": []}
    for outcomes in ranks:
        assert outcomes["sync then"]["error"] is None and outcomes["async then"]["error"] is None, outcomes


@pytest.mark.timeout(180)
def test_the_last_save_is_committed_when_the_script_destroys_the_process_group_first(failing_rank_results) -> None:
    """`dist.destroy_process_group()` while the last save is written in the background, then `run.finish()` on rank
    0 and nothing on rank 1 (its exit waits): the save is committed (failed before: destroying the group ended the
    write's collectives under it, and the last checkpoint was lost)."""
    ckpt_dir, died, _ = failing_rank_results
    assert died is None
    assert [i.step for i in list_checkpoints(ckpt_dir)] == [5, 4, 3]
    assert torch.equal(load_tensors(ckpt_dir / "step_000000005")["model.weight"], torch.full((4, 4), 5.0))


class _StuckLoader(_Loader):
    """A stateful object whose state takes `seconds` to read on this rank (a stuck read of a mount, say)."""

    def __init__(self, seconds: float) -> None:
        super().__init__(broken=False)
        self.seconds = seconds

    def state_dict(self) -> dict[str, object]:
        time.sleep(self.seconds)
        return super().state_dict()


def _meet(out_dir: str, name: str, rank: int, world_size: int) -> None:
    """Wait until every rank got here, without a collective (the ranks' groups are what is tested)."""
    Path(out_dir, f"{name}.{rank}").touch()
    while len(list(Path(out_dir).glob(f"{name}.*"))) < world_size:
        time.sleep(0.05)


def _stuck_rank_worker(rank: int, world_size: int, init_file: str, ckpt_dir: str, out_dir: str) -> None:
    """The job's timeout is 2 s; rank 1 is stuck for 6 s in a save, sync then async (rank 0 starts the latter while
    rank 1 is still in the former); then both save again; then rank 1 dies in the middle of a save."""
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=2))
    model = torch.nn.Linear(4, 4)
    save(ckpt_dir, 1, {"model": model})
    saver = AsyncSaver()
    objects = {"model": model, "loader": _StuckLoader(6 if rank == 1 else 0)}
    outcomes = {"sync": _save_outcome(lambda: save(ckpt_dir, 2, objects))}
    outcomes["async"] = _save_outcome(lambda: (saver.save(ckpt_dir, 2, objects, keep=3), saver.wait()))
    _meet(out_dir, "async", rank, world_size)
    outcomes["sync then"] = _save_outcome(lambda: save(ckpt_dir, 2, {"model": model}))
    outcomes["async then"] = _save_outcome(lambda: (saver.save(ckpt_dir, 3, {"model": model}, keep=3), saver.wait()))
    saver.close()
    if rank == 1:   # then it dies in the middle of a save, hashing its files
        Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcomes))
        checkpoint._sha256_all = lambda *args: os._exit(0)
    outcomes["gone"] = _save_outcome(lambda: save(ckpt_dir, 4, {"model": model}))
    outcomes["left"] = {"steps": [i.step for i in list_checkpoints(ckpt_dir)],
                        "temporary": [p.name for p in Path(ckpt_dir).glob(".tmp-*")]}
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(outcomes))


@pytest.mark.timeout(120)
def test_a_rank_stuck_in_a_save_fails_it_after_the_jobs_timeout(tmp_path: Path) -> None:
    """A rank stuck in a save past the timeout the job gave init_process_group: the others' save fails after that
    timeout, with a one-line CheckpointError, sync or async (a save whose group the stuck rank does not come to make
    anew too); the group is made anew, and the next saves work. A rank
    that dies mid-save fails it on the others at once, with a CheckpointError, and its partial files are removed
    (failed before: the save's group waited torch's default 30 minutes, here it waited for the stuck rank; a dead
    rank's peers raised gloo's RuntimeError and left the partial save's folder; a group not made, gloo's 'Wait
    timeout')."""
    ckpt_dir, out_dir = tmp_path / "ckpt", tmp_path / "out"
    out_dir.mkdir()
    mp.spawn(_stuck_rank_worker, args=(2, str(tmp_path / "init"), str(ckpt_dir), str(out_dir)), nprocs=2)
    ranks = [json.loads(p.read_text()) for p in sorted(out_dir.glob("rank*.json"))]
    for scenario in ("sync", "async"):
        outcome = ranks[0][scenario]
        assert outcome["error"] is not None and outcome["seconds"] < 5, (scenario, outcome)
        assert outcome["error"].startswith("CheckpointError: ") and "\n" not in outcome["error"], (scenario, outcome)
        assert ranks[1][scenario]["error"] is not None, (scenario, ranks[1][scenario])
    for outcomes in ranks:
        assert outcomes["sync then"]["error"] is None and outcomes["async then"]["error"] is None, outcomes
    gone = ranks[0]["gone"]
    assert gone["error"] is not None and gone["seconds"] < 5 and "\n" not in gone["error"], gone
    assert gone["error"].startswith("CheckpointError: ") and "lost touch" in gone["error"], gone
    assert ranks[0]["left"] == {"steps": [3, 2, 1], "temporary": []}


# --- in the background ----------------------------------------------------------------------


def test_async_save_writes_the_state_of_the_moment_it_was_called(tmp_path: Path) -> None:
    reference = make_objects(0)
    train(reference, 0, 4)
    saver = AsyncSaver()
    pending = saver.save(tmp_path, 4, reference, keep=3)
    expected = {k: v.clone() for k, v in reference["model"].state_dict().items()}
    train(reference, 4, TOTAL_STEPS)   # the training goes on while the save is written
    info = pending.result(timeout=60)
    assert info.step == 4 and list_checkpoints(tmp_path) == [dataclasses.replace(info, seconds=0.0)]
    tensors = load_tensors(info.path)
    assert all(torch.equal(tensors[f"model.{k}"], v) for k, v in expected.items())
    # The next save reuses the staging buffers: it holds its own moment, the first one keeps its own.
    later = saver.save(tmp_path, TOTAL_STEPS, reference, keep=3)
    expected_later = {k: v.clone() for k, v in reference["optimizer"].state_dict()["state"][0].items()}
    train(reference, TOTAL_STEPS, TOTAL_STEPS + 2)
    saver.close()
    assert later.result().step == TOTAL_STEPS
    moments = load_tensors(later.result().path)
    assert all(torch.equal(moments[f"optimizer.state.0.weight.{k}"], v) for k, v in expected_later.items())
    assert all(torch.equal(load_tensors(info.path)[f"model.{k}"], v) for k, v in expected.items())

    resumed = make_objects(123, fresh=True)
    assert restore(tmp_path, resumed).step == TOTAL_STEPS
    train(resumed, TOTAL_STEPS, TOTAL_STEPS + 2)
    assert_same_state(reference, resumed)


def test_async_saves_one_at_a_time_and_a_failure_surfaces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A save that finds the previous one still writing waits for it; a background failure is raised later."""
    model = torch.nn.Linear(4, 4)
    release, committing = threading.Event(), threading.Event()
    real_commit = checkpoint._commit

    def slow_commit(*args: object) -> object:
        committing.set()
        release.wait(30)
        return real_commit(*args)

    monkeypatch.setattr(checkpoint, "_commit", slow_commit)
    saver = AsyncSaver()
    first = saver.save(tmp_path, 1, {"model": model}, keep=3)
    assert committing.wait(30) and not first.done()
    second = threading.Thread(target=saver.save, args=(tmp_path, 2, {"model": model}), kwargs={"keep": 3})
    second.start()
    second.join(0.5)
    assert second.is_alive(), "the second save did not wait for the first"
    release.set()
    second.join(30)
    assert first.result().step == 1 and saver.wait().step == 2

    def no_space(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "_commit", no_space)
    saver.save(tmp_path, 3, {"model": model}, keep=3)
    with pytest.raises(CheckpointError, match="committing checkpoint .*step_000000003 failed: .*No space left"):
        saver.close()
    assert [i.step for i in list_checkpoints(tmp_path)] == [2, 1] and not list(tmp_path.glob(".tmp-*"))


def test_an_interrupted_wait_keeps_the_save_in_flight(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C while a rank waits for a background save (in a notebook, say) leaves that save in flight: the
    next save still waits for it (failed before: it was forgotten, and the next save staged into its buffers
    while it was being written, so step 1 held step 2's weights, with valid checksums)."""
    model = torch.nn.Linear(4, 4)
    release = threading.Event()
    real_write = checkpoint.SaveSession.write

    def slow_write(session: checkpoint.SaveSession, state: dict[str, object]) -> None:
        release.wait(30)
        real_write(session, state)

    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.SaveSession, "write", slow_write)
    saver = AsyncSaver()
    first = saver.save(tmp_path, 1, {"model": model}, keep=3)
    expected = model.weight.detach().clone()
    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(KeyboardInterrupt):
            saver.wait()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with torch.no_grad():
        model.weight.add_(1.0)
    threading.Timer(0.5, release.set).start()
    saver.save(tmp_path, 2, {"model": model}, keep=3)
    saver.close()
    assert torch.equal(load_tensors(first.result().path)["model.weight"], expected)


_KILLED_IN_BACKGROUND = """
import sys, time, torch
from orchestrator.sdk import checkpoint
from orchestrator.sdk.asyncsave import AsyncSaver
model = torch.nn.Linear(4, 4)
saver = AsyncSaver()
saver.save(sys.argv[1], 1, {"model": model}, keep=3).result()
def stuck(*args):
    print("writing", flush=True)
    time.sleep(120)
checkpoint._commit = stuck
with torch.no_grad():
    model.weight.add_(1)
saver.save(sys.argv[1], 2, {"model": model}, keep=3)
for step in range(10 ** 9):   # training goes on while step 2 is written
    model(torch.ones(1, 4))
"""


def test_kill_during_background_save_keeps_the_previous_checkpoint(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_IN_BACKGROUND, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        assert "writing\n" in iter(proc.stdout.readline, "")   # step 2's files are written, its commit not yet
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert len(list(tmp_path.glob(".tmp-step_000000002-*"))) == 1
    model = torch.nn.Linear(4, 4)
    assert restore(tmp_path, {"model": model}).step == 1
    assert [i.step for i in list_checkpoints(tmp_path)] == [1]


@pytest.mark.parametrize("env, anon", [({}, False), ({"AZURE_STORAGE_ANON": "true"}, "unset")])
def test_az_checkpoints_ask_the_machines_identity_unless_the_user_says_anonymous(monkeypatch, env, anon):
    """adlfs is anonymous unless told otherwise (AZURE_STORAGE_ANON defaults to true), so a VM's managed identity
    would never be asked for a token: the store and DCP's writer and reader open az:// with anon=False, unless the
    user set AZURE_STORAGE_ANON. (adlfs is not installed here: a filesystem registered for az:// records what the
    store asks of it, as fsspec hands it adlfs's storage options.)"""
    import importlib

    from fsspec.implementations.memory import MemoryFileSystem

    asked: list = []

    class Recording(MemoryFileSystem):
        protocol = ("az",)
        cachable = False

        def __init__(self, *args, **options):
            asked.append(options.get("anon", "unset"))
            super().__init__(*args, **options)

    monkeypatch.setitem(importlib.import_module("fsspec.registry")._registry, "az", Recording)
    monkeypatch.delenv("AZURE_STORAGE_ANON", raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    store = ckptstore.open_store("az://ckpt/run1")
    store.writer("az://ckpt/run1/step_000000001")
    store.reader("az://ckpt/run1/step_000000001")
    assert asked == [anon] * 3
