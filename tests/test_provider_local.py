"""The local provider's offer: this machine's memory as the jobs started here can use it."""
from __future__ import annotations

from pathlib import Path

import pytest

from providers.local import _host_memory_gib

MEMINFO = "MemTotal:       24683772 kB\nMemFree:         1191240 kB\nMemAvailable:   15000000 kB\n"   # 23.5 GiB
HOST_GIB = 24683772 / 2**20
V2, V1 = "sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory/memory.limit_in_bytes"


def _root(tmp_path: Path, **cgroup: str) -> Path:
    """A filesystem root holding this /proc/meminfo and the cgroup files given (v2 or v1: the file's text)."""
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text(MEMINFO)
    for name, text in cgroup.items():
        path = tmp_path / {"v2": V2, "v1": V1}[name]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


@pytest.mark.parametrize("cgroup, gib", [
    ({"v2": "4294967296\n"}, 4.0),                     # `docker run -m 4g` on cgroup v2: was the host's 23.5 GiB
    ({"v1": "4294967296\n"}, 4.0),                     # the same on cgroup v1
    ({"v2": "max\n"}, HOST_GIB),                       # v2 without a limit
    ({"v1": "9223372036854771712\n"}, HOST_GIB),       # v1 without a limit: LONG_MAX rounded to a page
    ({"v2": "68719476736\n"}, HOST_GIB),               # a limit above the host's memory limits nothing
    ({}, HOST_GIB),                                    # no cgroup memory controller
])
def test_the_host_memory_is_the_cgroup_limit_where_lower(tmp_path, cgroup, gib):
    assert _host_memory_gib(_root(tmp_path, **cgroup)) == pytest.approx(gib)


def test_without_meminfo_the_memory_is_unknown(tmp_path):
    assert _host_memory_gib(tmp_path) == 0.0           # no /proc/meminfo: as before, nothing is known
