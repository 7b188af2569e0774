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

__all__ = ["Run", "init", "jax", "main", "optimize"]


def __getattr__(name: str) -> Any:
    """The SDK is imported on first use: the CLI must not pay for importing torch."""
    if name in ("Run", "init"):
        from orchestrator.sdk import run
        return getattr(run, name)
    if name == "optimize":
        from optimizer.backend import optimize
        return optimize
    if name == "jax":                        # tfsn.jax.optimize: needs JAX (pip install 'tfsn[jax]')
        import optimizer.jax_backend
        return optimizer.jax_backend
    raise AttributeError(f"module 'tfsn' has no attribute {name!r}")


def main() -> None:
    """The `tfsn` console script."""
    try:
        from orchestrator.cli.main import main as cli_main
    except KeyboardInterrupt:            # Ctrl-C while the CLI loads: nothing was done yet
        raise SystemExit(130) from None
    cli_main()


if __name__ == "__main__":
    main()
