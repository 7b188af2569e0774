"""Processes of this machine, found by their environment and told apart from a reused pid.

Shared by the local driver (a local node is every process tagged with its id) and the node agent (a
stopped attempt's workers, wherever torchrun's sessions reparented them): neither owns the other.
"""
from __future__ import annotations

import os
from pathlib import Path


def start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` (clock ticks since boot), so a reused pid is not mistaken."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2:].split()
    if fields[0] == "Z":  # a zombie has exited
        return None
    return int(fields[19])


def pids_with_env(**wanted: str) -> list[int]:
    """Every live process on this machine (but this one) whose environment holds each KEY=VALUE given.

    Children inherit their environment wherever they are reparented, so this finds a process tree
    even after its root was killed.
    """
    tags = {f"{key}={value}".encode() for key, value in wanted.items()}
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue
        if tags <= set(environ.split(b"\0")) and start_time(int(entry.name)) is not None:
            found.append(int(entry.name))
    return found
