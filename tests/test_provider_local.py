"""The local provider's offer: this machine's memory as the jobs started here can use it."""
from __future__ import annotations

from pathlib import Path

import pytest

from providers.local import _host_memory_gib

MEMINFO = "MemTotal:       24683772 kB\nMemFree:         1191240 kB\nMemAvailable:   15000000 kB\n"   # 23.5 GiB
HOST_GIB = 24683772 / 2**20
V2, V1 = "sys/fs/cgroup/memory.max", "sys/fs/cgroup/memory/memory.limit_in_bytes"
# /proc/self/mountinfo's line of a cgroup hierarchy: the cgroup shown at its top, and where it is mounted
V2_MOUNT, V1_MOUNT = "35 24 0:30 {top} {at} rw - cgroup2 cgroup2 rw\n", "36 24 0:31 {top} {at} rw - cgroup cgroup rw,memory\n"
CONTAINER = {"proc/self/cgroup": "0::/\n4:memory:/\n",      # with its own cgroup namespace: its cgroup is the top
             "proc/self/mountinfo": V2_MOUNT.format(top="/", at="/sys/fs/cgroup")
             + V1_MOUNT.format(top="/", at="/sys/fs/cgroup/memory")}


def _root(tmp_path: Path, files: dict[str, str] = CONTAINER, **cgroup: str) -> Path:
    """A filesystem root holding this /proc/meminfo, `files` (path: text: this process's cgroups and their mounts) and
    the container's cgroup files given (v2 or v1: the file's text)."""
    for name, text in {"proc/meminfo": MEMINFO, **files, **{{"v2": V2, "v1": V1}[k]: v for k, v in cgroup.items()}}.items():
        path = tmp_path / name
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


GIB4 = "4294967296\n"


@pytest.mark.parametrize("files", [
    {  # a systemd service's MemoryMax=4G on cgroup v2: was the host's 23.5 GiB (only the hierarchy's top was read)
        "proc/self/cgroup": "0::/system.slice/train.service\n",
        "proc/self/mountinfo": V2_MOUNT.format(top="/", at="/sys/fs/cgroup"),
        "sys/fs/cgroup/system.slice/train.service/memory.max": GIB4},
    {  # the same limit on its slice: a cgroup above the process's limits it too
        "proc/self/cgroup": "0::/system.slice/train.service\n",
        "proc/self/mountinfo": V2_MOUNT.format(top="/", at="/sys/fs/cgroup"),
        "sys/fs/cgroup/system.slice/memory.max": GIB4,
        "sys/fs/cgroup/system.slice/train.service/memory.max": "max\n"},
    {  # a Slurm job's --mem=4G on cgroup v1
        "proc/self/cgroup": "5:cpu:/\n4:memory:/slurm/uid_1000/job_7\n0::/\n",
        "proc/self/mountinfo": V1_MOUNT.format(top="/", at="/sys/fs/cgroup/memory"),
        "sys/fs/cgroup/memory/slurm/uid_1000/job_7/memory.limit_in_bytes": GIB4},
    {  # cgroup v1 mounted elsewhere than /sys/fs/cgroup
        "proc/self/cgroup": "4:memory:/job\n",
        "proc/self/mountinfo": V1_MOUNT.format(top="/", at="/cgroup/memory"),
        "cgroup/memory/job/memory.limit_in_bytes": GIB4},
    {  # a container without a cgroup namespace: its cgroup is mounted as the top, its path the host's
        "proc/self/cgroup": "4:memory:/docker/abc\n",
        "proc/self/mountinfo": V1_MOUNT.format(top="/docker/abc", at="/sys/fs/cgroup/memory"),
        V1: GIB4},
])
def test_the_limit_is_the_process_own_cgroup_or_one_above(tmp_path, files):
    assert _host_memory_gib(_root(tmp_path, files)) == pytest.approx(4.0)
