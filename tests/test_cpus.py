"""The CPU budget (``procpipe._core.cpus``): affinity and cgroup quotas, read from fake trees."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from procpipe._core import cpus
from procpipe._core.cpus import cpu_budget, cpu_quota

pytestmark = pytest.mark.unit  # starts no process: `python -m pytest -m unit` (tests/conftest.py)

V2_MOUNT = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw\n"
V1_MOUNTS = (
    "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw,mode=755\n"
    "32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
    "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
)


def tree(root: Path, files: dict[str, str]) -> str:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def v2(root: Path, cpu_max: str | None, group: str = "/job") -> str:
    files = {"proc/self/cgroup": f"0::{group}\n", "proc/self/mountinfo": V2_MOUNT}
    if cpu_max is not None:
        files[f"sys/fs/cgroup{group}/cpu.max"] = cpu_max + "\n"
    return tree(root, files)


def test_cgroup_v2_quota_of_two_cpus(tmp_path):
    root = v2(tmp_path, "200000 100000")
    assert cpu_quota(root) == 2.0
    assert cpu_budget(root, affinity=16) == 2


def test_cgroup_v2_max_is_no_limit(tmp_path):
    root = v2(tmp_path, "max 100000")
    assert cpu_quota(root) is None
    assert cpu_budget(root, affinity=16) == 16


def test_a_fractional_quota_rounds_up_and_never_below_one(tmp_path):
    assert cpu_budget(v2(tmp_path / "a", "150000 100000"), affinity=16) == 2
    assert cpu_budget(v2(tmp_path / "b", "10000 100000"), affinity=16) == 1


def test_affinity_below_the_quota_wins(tmp_path):
    assert cpu_budget(v2(tmp_path, "800000 100000"), affinity=3) == 3


def test_an_ancestor_cgroup_limits_too(tmp_path):
    root = v2(tmp_path, "max 100000", group="/kubepods/pod1/ctr")
    (tmp_path / "sys/fs/cgroup/kubepods/pod1/cpu.max").write_text("300000 100000\n")
    assert cpu_budget(root, affinity=64) == 3


def test_inside_a_cgroup_namespace_the_mount_root_holds_the_limit(tmp_path):
    """A container sees itself at ``0::/`` and its limit at the mount's own cpu.max."""
    root = tree(tmp_path, {"proc/self/cgroup": "0::/\n", "proc/self/mountinfo": V2_MOUNT,
                           "sys/fs/cgroup/cpu.max": "400000 100000\n"})
    assert cpu_budget(root, affinity=32) == 4


@pytest.mark.parametrize("quota, period, expected", [("200000", "100000", 2), ("-1", "100000", 16),
                                                     ("250000", "100000", 3)])
def test_cgroup_v1_cfs_quota(tmp_path, quota, period, expected):
    root = tree(tmp_path, {
        "proc/self/cgroup": "4:memory:/x\n3:cpu,cpuacct:/docker/abc\n0::/\n",
        "proc/self/mountinfo": V1_MOUNTS,
        "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": quota + "\n",
        "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": period + "\n",
    })
    assert cpu_budget(root, affinity=16) == expected


def test_missing_or_garbled_files_mean_no_limit(tmp_path):
    assert cpu_budget(str(tmp_path / "nothing"), affinity=8) == 8
    root = v2(tmp_path / "garbled", "lots 100000")
    assert cpu_budget(root, affinity=8) == 8
    root = v2(tmp_path / "missing", None)
    assert cpu_budget(root, affinity=8) == 8


def test_this_process_budget_is_at_most_its_affinity():
    assert 1 <= cpu_budget() <= cpus.affinity_count() <= (os.cpu_count() or 1)
