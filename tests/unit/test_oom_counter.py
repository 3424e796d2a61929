"""How a launcher tells an OOM kill from a SIGKILL (launch/oom.py), the `oom` fault that causes
one (inject.py), and the coordinator's count of the kills launchers report
(coordinator/oom_kills.py): the parsing is pure and fed the texts the kernel writes; the
counter reads a directory laid out as the kernel's. tests/integration/test_oom_kill.py has
the kernel itself OOM-kill a worker in a memory cgroup."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from transom import contract, inject
from transom.coordinator.models import FailureReport, Identity
from transom.coordinator.oom_kills import OomKills
from transom.launch import oom

# /proc/self/mountinfo lines as the kernel writes them.
HOST_V1 = """31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
POD = "/kubepods/burstable/pod1234/abcd"
CONTAINER_V1 = f"1210 1209 0:32 {POD} /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime master:16 - " \
               "cgroup cgroup rw,memory\n"
CONTAINER_V2 = "1300 1299 0:27 / /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate\n"
HOST_V2 = "29 23 0:27 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:4 - cgroup2 cgroup2 rw,nsdelegate\n"


@pytest.mark.parametrize("proc_cgroup, mountinfo, found", [
    # This machine's kind: cgroup v1 hybrid, v2 mounted beside it without the memory controller.
    ("9:name=systemd:/\n4:memory:/process_api/f8a3\n0::/\n", HOST_V1,
     oom.MemoryCgroup(Path("/sys/fs/cgroup/memory/process_api/f8a3"), 1)),
    # A container on v1 (containerd): the host's path, the mount's root is the container's cgroup.
    (f"4:memory:{POD}\n3:cpu,cpuacct:{POD}\n", CONTAINER_V1, oom.MemoryCgroup(Path("/sys/fs/cgroup/memory"), 1)),
    # A container on v2 with its own cgroup namespace, and a v2 host.
    ("0::/\n", CONTAINER_V2, oom.MemoryCgroup(Path("/sys/fs/cgroup"), 2)),
    ("0::/user.slice/job.scope\n", HOST_V2, oom.MemoryCgroup(Path("/sys/fs/cgroup/user.slice/job.scope"), 2)),
    # Unknown, never an error: no memory hierarchy, no mount of it, a path outside the mount.
    ("3:cpu:/\n", HOST_V1, None),
    ("4:memory:/a\n", "", None),
    ("4:memory:/elsewhere\n", CONTAINER_V1, None),
    ("", "", None),
], ids=["v1-hybrid-host", "v1-container", "v2-container", "v2-host", "no-memory", "no-mount", "outside", "empty"])
def test_the_memory_cgroup_is_found_from_proc_self(proc_cgroup, mountinfo, found):
    assert oom.locate(proc_cgroup, mountinfo) == found


def test_the_kill_counter_and_the_limit_are_parsed_as_the_kernel_writes_them():
    assert oom.parse_oom_kills("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n") == 3  # v1 memory.oom_control
    assert oom.parse_oom_kills("low 0\nhigh 0\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n") == 1  # v2 memory.events
    assert oom.parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n") is None  # a kernel before 4.13
    assert oom.parse_oom_kills("") is None
    assert oom.parse_limit("9223372036854771712\n") is None and oom.parse_limit("max\n") is None
    assert oom.parse_limit("3221225472\n") == 3 << 30 and oom.parse_limit("garbage") is None


@pytest.mark.parametrize("n, text", [(3 << 30, "3Gi"), (768 << 20, "768Mi"), (599998464, "600M"),
                                     (2 * 10**9 - 2 * 10**9 % 4096, "2G"), (1536 << 10, "1536Ki"), (12345, "12345")])
def test_a_limit_reads_as_the_pods_resources_would_write_it(n, text):
    assert oom.quantity(n) == text


def _cgroup(tmp_path: Path, kills: int | None, limit: str = "805306368\n") -> oom.MemoryCgroup:
    if kills is not None:
        (tmp_path / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {kills}\n")
    (tmp_path / "memory.limit_in_bytes").write_text(limit)
    return oom.MemoryCgroup(tmp_path, 1)


def test_the_counter_says_whether_a_kill_came_since_its_mark_and_waits_a_little_for_a_late_count(tmp_path):
    counter = oom.Counter(_cgroup(tmp_path, 4))
    counter.mark()
    assert counter.rose() is False and counter.limit() == "768Mi"
    # The count lands a moment after the victim was reaped: looked at again, within patience.
    threading.Timer(0.05, lambda: _cgroup(tmp_path, 5)).start()
    t0 = time.monotonic()
    assert counter.rose(patience_s=2.0) is True and time.monotonic() - t0 < 1.0
    counter.mark()
    t0 = time.monotonic()
    assert counter.rose(patience_s=0.1) is False and time.monotonic() - t0 >= 0.1
    assert oom.Counter(_cgroup(tmp_path, 5, limit="9223372036854771712\n")).limit() is None


def test_no_cgroup_or_a_vanished_counter_is_unknown_never_an_error(tmp_path):
    nothing = oom.Counter(None)
    nothing.mark()
    assert nothing.rose(patience_s=1.0) is None and nothing.limit() is None
    gone = oom.Counter(_cgroup(tmp_path, 1))
    gone.mark()
    (tmp_path / "memory.oom_control").unlink()
    assert gone.rose() is None
    assert oom.Counter(oom.MemoryCgroup(tmp_path / "missing", 2)).limit() is None


def test_the_oom_fault_parses_fires_from_its_step_on_and_targets_a_replica_from_the_environment():
    fault = inject.Fault.parse("oom:step=5,replica=1")
    assert (fault.action, fault.step, fault.replica, fault.mb, fault.phase) == ("oom", 5, 1, None, "allreduce")
    assert fault.count == inject.FOREVER  # a restarted replica joins later than step 5: it still fires
    env = {contract.ENV_FAULT: "oom:step=5,replica=1;oom:step=5,replica=1,phase=forward,mb=4096"}
    assert inject.from_environ(0, env, replica=0) is None
    assert inject.from_environ(1, env, replica=1) == inject.Fault("oom", 5, phase="forward", count=inject.FOREVER,
                                                                   replica=1, mb=4096)
    assert inject.from_environ(2, env, replica=1) is None
    assert inject.parse_targeted("oom:replica=1,step=5") == (1, "oom:step=5")
    for bad, says in (("oom:step=5,mb=0", "mb"), ("kill:step=5,mb=10", "mb is for oom"),
                      ("oom:step=5,replica=x", "replica must be")):
        with pytest.raises(ValueError, match=says):
            inject.Fault.parse(bad)


def test_the_oom_fault_refuses_to_exhaust_a_machine_without_a_limit(monkeypatch):
    monkeypatch.setattr(oom, "find", lambda: None)
    with pytest.raises(RuntimeError, match="no memory limit"):
        inject.Fault.parse("oom:step=0").maybe_fire(0, 0, "allreduce")
    with pytest.raises(RuntimeError, match="allocated 1 MiB and was not OOM-killed"):  # mb: allocates anyway
        inject.Fault.parse("oom:step=0,mb=1").maybe_fire(3, 0, "allreduce")
    inject.Fault.parse("oom:step=4,mb=1").maybe_fire(3, 0, "allreduce")  # before its step: nothing


def _report(generation: int, attempt: int, reason: str, replica: int = 1) -> FailureReport:
    return FailureReport(identity=Identity(replica_id=replica, generation=generation, attempt=attempt), reason=reason)


def test_the_coordinator_counts_each_reported_oom_kill_once_for_status():
    kills = OomKills()
    said = "OOMKilled: worker rank 0 was OOMKilled (memory limit 3Gi)"
    assert kills.record(_report(0, 0, said), 1735689605.0)
    assert not kills.record(_report(0, 0, said), 1735689606.0)  # the launcher's retry of the same report
    assert not kills.record(_report(0, 1, "worker local rank 0 exited with code 1"), 1735689607.0)  # not an OOM
    assert kills.record(_report(1, 0, said), 1735689609.0)  # the next generation's: counted on
    assert not kills.record(_report(0, 2, said), 1735689610.0)  # late, about an older incarnation
    assert kills.record(_report(0, 0, said, replica=0), 1735689611.0)
    assert kills.status() == [
        {"replica": 0, "generation": 0, "count": 1, "time": "2025-01-01T00:00:11Z",
         "message": "worker rank 0 was OOMKilled (memory limit 3Gi)"},
        {"replica": 1, "generation": 1, "count": 2, "time": "2025-01-01T00:00:09Z",
         "message": "worker rank 0 was OOMKilled (memory limit 3Gi)"},
    ]


def test_non_ascii_digits_are_no_number_in_a_cgroup_file_or_a_fault_spec():
    # str.isdigit() takes a superscript two; int() does not: these said ValueError, not "none".
    assert oom.parse_limit("\u00b2\n") is None
    assert oom.parse_oom_kills("oom_kill \u00b2\n") is None
    with pytest.raises(ValueError, match="non-negative integer"):
        inject.Fault.parse("kill:step=\u00b2")
