"""A pytest plugin for benchmarks/gpu_check.sh (`-p benchmarks.failures_now`): each failure is written to the log,
with its test id and the end of its report, when it happens rather than in pytest's summary at the end. The lent
GPU's time is short and a part that runs out of it is killed: without this, its log said that tests failed
(an F among the dots) but never which ones or why."""
from __future__ import annotations

import pytest

REPORT_LINES = 30               # the end of a failure's report: the assertion and the lines that led to it
_printing = True


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist only the controller prints: its workers' reports reach it, and their own output is not kept."""
    global _printing
    _printing = not hasattr(config, "workerinput")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not (_printing and report.failed):
        return
    lines = report.longreprtext.strip().splitlines()[-REPORT_LINES:]
    print(f"\nFAILED {report.nodeid} ({report.when}, {report.duration:.1f} s)", *lines, sep="\n", flush=True)
