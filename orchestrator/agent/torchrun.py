"""torchrun as the agent runs it: `python orchestrator/agent/torchrun.py ARGS` is `torchrun ARGS`, but its own
failures are lines, not Python tracebacks of torchrun's internals in the job log.

torchrun ends a failed attempt by raising ChildFailedError out of its main (a traceback through runpy and
launcher/api.py above the "Root Cause" block), and logs a node that finished first but whose peers never reached
the exit barrier with `logger.exception` (a traceback through store_util). Its C++ side warns of a store connection
that the node hosting it closed first with the C++ stack (`frame #0: c10::Error::Error ...`): once the job is done
on the node that hosts the store, the others' last read at the exit barrier races its exit. The user's own
tracebacks come from the workers, prefixed with their rank, and are untouched, as is their TORCH_CPP_LOG_LEVEL.
"""
from __future__ import annotations

import logging
import os
import sys

EXIT_BARRIER_LOGGER = "torch.distributed.elastic.agent.server.api"
CPP_LOG_LEVEL = "TORCH_CPP_LOG_LEVEL"


class OneLine(logging.Filter):
    """A record logged with an exception becomes one line ending with the exception's type and message."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            err = record.exc_info[1]
            record.msg = f"{record.getMessage()}: {type(err).__name__}: {' '.join(str(err).split())}"
            record.args = None
            record.exc_info = record.exc_text = None
        return True


def main() -> int:
    """torchrun's exit code: 0, or 1 with its error on stderr: for failed workers the Root Cause block (which the
    agent's failure summary reads), for torchrun's own error (a rendezvous that timed out, a port in use) its
    type and message."""
    workers_level = os.environ.get(CPP_LOG_LEVEL)
    os.environ[CPP_LOG_LEVEL] = "ERROR"          # read as libtorch loads: this process's C++ warnings only
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main
    if workers_level is None:                    # the workers inherit this environment: theirs as it was
        del os.environ[CPP_LOG_LEVEL]
    else:
        os.environ[CPP_LOG_LEVEL] = workers_level
    logging.getLogger(EXIT_BARRIER_LOGGER).addFilter(OneLine())
    try:
        torchrun_main()
    except ChildFailedError as err:
        print(err, file=sys.stderr, flush=True)
        return 1
    except Exception as err:   # noqa: BLE001 - whatever torchrun raised, as one line
        print(f"torchrun failed: {type(err).__name__}: {' '.join(str(err).split())}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
