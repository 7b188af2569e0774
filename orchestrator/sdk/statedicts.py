"""The state dicts of a model and its optimizers as torch.distributed.checkpoint keys them, read fast enough
for every save of a run.

DCP's `get_model_state_dict` and `get_optimizer_state_dict` key tensors by their FQN (no DDP `module.`
or torch.compile `_orig_mod.` segment; optimizer state by parameter name, not index). To do so they walk
the module tree on every call: 1-2 ms each for the example's 0.4M-parameter model on this busy machine,
half of an asynchronous save's stall once the writing was off the training thread. `StateDictReader`
asks DCP the first time, learns how the object's own `state_dict()` (tens of microseconds) maps onto
DCP's keys, and keeps that mapping only if it reproduces DCP's result exactly (the same keys, the same
tensors, equal values). Later reads rename the object's own state dict, for as long as what the mapping
depends on is unchanged: the module's state-dict keys; for an optimizer, its parameters and the model's
named parameters, the same objects in the same order. Anything else (FSDP, DTensor, extra state that is
not a tensor, a mapping DCP's result disagrees with) is read through DCP every time.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

WRAPPER_SEGMENTS = ("module", "_orig_mod")   # the key segments DCP drops (DDP, torch.compile)


@dataclass(frozen=True)
class _Learned:
    fingerprint: tuple[Any, ...]
    renames: dict[Any, str] | None     # own key (a state-dict key; a parameter index) -> DCP's; None: use DCP


class StateDictReader:
    """DCP's state dicts of modules and optimizers, from their own state_dict() once learned (see module doc)."""

    def __init__(self) -> None:
        self._learned: weakref.WeakKeyDictionary[object, _Learned] = weakref.WeakKeyDictionary()

    def model(self, module: torch.nn.Module) -> dict[str, Any]:
        own = module.state_dict()
        fingerprint = tuple(own)
        learned = self._learned.get(module)
        if learned is None or learned.fingerprint != fingerprint:
            expected = get_model_state_dict(module)
            renames = _model_renames(own, expected)
            self._learned[module] = _Learned(fingerprint, renames)
            return expected
        if learned.renames is None:
            return get_model_state_dict(module)
        return {learned.renames[key]: value for key, value in own.items()}

    def optimizer(self, model: torch.nn.Module | None, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        parameters = tuple((name, id(p)) for name, p in model.named_parameters()) if model is not None else ()
        fingerprint = (id(model), parameters, tuple(id(p) for group in optimizer.param_groups for p in group["params"]))
        learned = self._learned.get(optimizer)
        if learned is None or learned.fingerprint != fingerprint:
            expected = get_optimizer_state_dict(model, optimizer)   # first: DCP creates a state not yet there
            renames = _optimizer_renames(optimizer.state_dict(), expected)
            self._learned[optimizer] = _Learned(fingerprint, renames)
            return expected
        if learned.renames is None:
            return get_optimizer_state_dict(model, optimizer)
        return _renamed_optimizer(optimizer.state_dict(), learned.renames)


def _model_renames(own: dict[str, Any], expected: dict[str, Any]) -> dict[Any, str] | None:
    """Own key -> DCP key: the one holding the same tensor whose key is the own key less wrapper segments."""
    renames: dict[Any, str] = {}
    for key, value in own.items():
        matches = [fqn for fqn in expected if _drops_wrappers(key, fqn) and _same(value, expected[fqn])]
        if len(matches) != 1:
            return None
        renames[key] = matches[0]
    renamed = {renames[key]: value for key, value in own.items()}
    return renames if _same(renamed, expected) else None


def _drops_wrappers(key: str, fqn: str) -> bool:
    """`fqn` is `key` with zero or more wrapper segments left out."""
    wanted, matched = fqn.split("."), 0
    for segment in key.split("."):
        if matched < len(wanted) and segment == wanted[matched]:
            matched += 1
        elif segment not in WRAPPER_SEGMENTS:
            return False
    return matched == len(wanted)


def _optimizer_renames(own: dict[str, Any], expected: dict[str, Any]) -> dict[Any, str] | None:
    """Parameter index -> FQN, read off the parameter groups (DCP keeps their order); None if it does not
    reproduce DCP's state dict."""
    groups, expected_groups = own.get("param_groups"), expected.get("param_groups")
    if not isinstance(groups, list) or not isinstance(expected_groups, list) or len(groups) != len(expected_groups):
        return None
    renames: dict[Any, str] = {}
    for group, expected_group in zip(groups, expected_groups):
        if len(group["params"]) != len(expected_group["params"]):
            return None
        renames.update(zip(group["params"], expected_group["params"]))
    try:
        renamed = _renamed_optimizer(own, renames)
    except KeyError:
        return None
    return renames if _same(renamed, expected) else None


def _renamed_optimizer(own: dict[str, Any], renames: dict[Any, str]) -> dict[str, Any]:
    return {"state": {renames[index]: state for index, state in own["state"].items()},
            "param_groups": [{**group, "params": [renames[index] for index in group["params"]]}
                             for group in own["param_groups"]]}


def _same(a: Any, b: Any) -> bool:
    """The same plain tensors (one storage, shape, strides, dtype) and equal other values, all the way down."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        plain = (torch.Tensor, torch.nn.Parameter)
        return (type(a) in plain and type(b) in plain and a.device == b.device and a.data_ptr() == b.data_ptr()
                and a.shape == b.shape and a.stride() == b.stride() and a.dtype == b.dtype)
    if isinstance(a, dict) and isinstance(b, dict):
        return set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    if type(a) in (list, tuple) and type(a) is type(b):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, (bool, int, float, str, bytes, type(None))) and type(a) is type(b):
        return a == b
    return False   # anything else (extra state objects): not known to be the same, so read through DCP
