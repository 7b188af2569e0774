"""StateDictReader gives what torch.distributed.checkpoint's state-dict functions give, save after save."""
from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

from orchestrator.sdk import statedicts
from orchestrator.sdk.statedicts import StateDictReader


class Tied(torch.nn.Module):
    """Weight tying, as GPT's embedding and head: one tensor under two keys."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(11, 6)
        self.body = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.GELU(), torch.nn.LayerNorm(6))
        self.head = torch.nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(idx)))


def step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(11, (4, 5), generator=g)
    loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    for group in optimizer.param_groups:   # a schedule: the groups' values change between saves
        group["lr"] *= 0.9


def assert_same(got: Any, expected: Any, where: str = "") -> None:
    if isinstance(expected, dict):
        assert isinstance(got, dict) and set(got) == set(expected), f"{where}: keys {sorted(got)} != {sorted(expected)}"
        for key in expected:
            assert_same(got[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}.{i}")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and torch.equal(got, expected), where
        assert got.data_ptr() == expected.data_ptr(), f"{where}: not the live tensor"   # staged as it is now
    else:
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tied()
    body = list(model.body.parameters())
    rest = [p for p in model.parameters() if all(p is not q for q in body)]
    optimizer = torch.optim.AdamW([{"params": rest}, {"params": body, "weight_decay": 0.0}], lr=1e-2)
    return model, optimizer


def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the reader asks DCP, per function."""
    calls = {"model": 0, "optimizer": 0}
    for kind, real in (("model", get_model_state_dict), ("optimizer", get_optimizer_state_dict)):
        def asked(*args: Any, kind: str = kind, real: Any = real) -> Any:
            calls[kind] += 1
            return real(*args)
        monkeypatch.setattr(statedicts, f"get_{kind}_state_dict", asked)
    return calls


def test_reads_what_dcp_reads_save_after_save(monkeypatch: pytest.MonkeyPatch) -> None:
    model, optimizer = make()
    wrapped = torch.compile(model)   # keys under `_orig_mod.`: DCP drops that segment (never run: no compile)
    reader, asked = StateDictReader(), counted(monkeypatch)
    for seed in range(4):   # the first save learns (before any step: DCP creates the optimizer's state)
        assert_same(reader.model(wrapped), get_model_state_dict(wrapped), "model")
        assert_same(reader.optimizer(wrapped, optimizer), get_optimizer_state_dict(wrapped, optimizer), "optimizer")
        step(model, optimizer, seed)
    assert "embed.weight" in reader.model(wrapped) and "head.weight" in reader.model(wrapped)
    assert asked == {"model": 1, "optimizer": 1}, "DCP's slow walk was not learned once"


def test_follows_a_model_and_an_optimizer_that_change() -> None:
    model, optimizer = make()
    reader = StateDictReader()
    step(model, optimizer, 0)
    reader.model(model), reader.optimizer(model, optimizer)
    model.extra = torch.nn.Linear(6, 6)                 # new keys in the model ...
    optimizer.add_param_group({"params": list(model.extra.parameters()), "lr": 1e-3})   # ... and its optimizer
    step(model, optimizer, 1)
    model.extra(torch.ones(6)).sum().backward()
    optimizer.step()
    assert_same(reader.model(model), get_model_state_dict(model), "model")
    assert_same(reader.optimizer(model, optimizer), get_optimizer_state_dict(model, optimizer), "optimizer")
    model.body[0] = torch.nn.Linear(6, 6)               # a module swapped for another: other parameters, same keys
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    step(model, optimizer, 2)
    assert_same(reader.model(model), get_model_state_dict(model), "model")
    assert_same(reader.optimizer(model, optimizer), get_optimizer_state_dict(model, optimizer), "optimizer")


class WithExtraState(torch.nn.Linear):
    """Extra state that is not a tensor: the reader cannot tell it is the same, so DCP reads it."""

    def __init__(self) -> None:
        super().__init__(3, 3)
        self.calls = 0

    def get_extra_state(self) -> dict[str, int]:
        self.calls += 1
        return {"calls": self.calls}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]


def test_what_it_cannot_map_is_read_through_dcp(monkeypatch: pytest.MonkeyPatch) -> None:
    model = WithExtraState()
    reader, asked = StateDictReader(), counted(monkeypatch)
    for _ in range(3):
        got = reader.model(model)
        assert got["_extra_state"] == {"calls": model.calls}
        assert torch.equal(got["weight"], model.weight)
    assert asked["model"] == 3
