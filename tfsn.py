"""tfsn: the public face. The SDK used in training scripts, and the `tfsn` command.

    import tfsn
    run = tfsn.init()
    model = tfsn.optimize(model)             # = torch.compile(model, backend="tfsn")
    step = tfsn.jax.optimize(train_step)     # a JAX step, called as jax.jit(train_step) is
    start = run.restore(model=model, optimizer=opt)
    for step in run.steps(start, total_steps):
        loss = train_step(...)
        run.log(loss=loss)
        run.checkpoint(model=model, optimizer=opt)

This module only wires the packages together; the logic lives in `orchestrator/` and friends.
"""
from __future__ import annotations

from typing import Any

__all__ = ["Run", "init", "jax", "main", "optimize", "tfsn_backend"]

PACKAGES = ("orchestrator", "optimizer", "health", "providers")     # tfsn's own, installed beside this file


class ShadowedPackage(ImportError):
    """A module of the user's has the name of one of tfsn's packages and comes first on sys.path."""


def check_packages(names: tuple[str, ...] = PACKAGES) -> None:
    """Fail in one line where a training script's own `optimizer.py` (or `health.py`, ...), first on sys.path
    as the script's folder is, would be imported in place of tfsn's package of that name (of `names`, those the
    caller imports): tfsn then failed deep in an import ("'optimizer' is not a package"). Two modules cannot share
    a top-level name: one must be renamed."""
    import importlib.util
    import sys
    from pathlib import Path

    home = Path(__file__).resolve().parent
    for name in names:
        module = sys.modules.get(name)
        spec = module.__spec__ if module is not None else importlib.util.find_spec(name)
        if spec is None:
            continue                            # not installed: its import says so
        # a folder without __init__.py (a namespace package) is found before tfsn's own under an editable install
        where = spec.origin if spec.has_location else next(iter(spec.submodule_search_locations or ()), None)
        if where is not None and home not in Path(where).resolve().parents:
            raise ShadowedPackage(f"tfsn: {where} is imported as `{name}`, the name of tfsn's own package "
                                  f"({home / name}): rename that module of yours (tfsn cannot run beside it)")


def __getattr__(name: str) -> Any:
    """The SDK is imported on first use: the CLI must not pay for importing torch."""
    if name in ("Run", "init"):
        check_packages()
    if name in ("optimize", "jax", "tfsn_backend"):
        check_packages(("optimizer",))          # it imports no other of tfsn's packages: a user's health.py may stay
    if name in ("Run", "init"):
        from orchestrator.sdk import run
        return getattr(run, name)
    if name == "optimize":
        from optimizer.backend import optimize
        return optimize
    if name == "tfsn_backend":               # torch.compile(backend="tfsn"): the entry point torch loads
        from optimizer.backend import tfsn_backend
        return tfsn_backend
    if name == "jax":                        # tfsn.jax.optimize: needs JAX (pip install 'tfsn[jax]')
        import optimizer.jax_backend
        return optimizer.jax_backend
    raise AttributeError(f"module 'tfsn' has no attribute {name!r}")


def main() -> None:
    """The `tfsn` console script."""
    from orchestrator.cli.interrupts import raise_if_interrupted, remember_interrupts

    remember_interrupts()
    try:
        from orchestrator.cli.main import main as cli_main
        raise_if_interrupted()           # one that the import's weakref callbacks dropped
    except KeyboardInterrupt:            # Ctrl-C while the CLI loads: nothing was done yet
        import sys
        print("tfsn: interrupted", file=sys.stderr)     # as the CLI says it later (was a silent exit)
        raise SystemExit(130) from None
    cli_main()


if __name__ == "__main__":
    main()
