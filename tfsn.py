"""tfsn: the public face. The SDK used in training scripts, and the `tfsn` command.

    import tfsn
    run = tfsn.init()
    start = run.restore(model=model, optimizer=opt)
    for step in run.steps(start, total_steps):
        loss = train_step(...)
        run.log(loss=loss)
        run.checkpoint(model=model, optimizer=opt)

This module only wires the packages together; the logic lives in `orchestrator/` and friends.
"""
from __future__ import annotations

from orchestrator.sdk import Run, init

__all__ = ["Run", "init", "main"]


def main() -> None:
    """The `tfsn` console script."""
    from orchestrator.cli import main as cli_main  # the CLI's imports are not needed by training scripts
    cli_main()


if __name__ == "__main__":
    main()
