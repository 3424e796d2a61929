"""A worker really OOM-killed by the kernel in a memory cgroup with a limit, as in a container.

The test makes a cgroup v1 memory cgroup below its own with a 768Mi limit (root and the v1
memory hierarchy needed: skipped elsewhere), starts a real `transom run --replicas 1` in it,
and has the worker's `oom` fault (transom/inject.py) allocate and touch memory until the
kernel's OOM killer ends it. The launcher sees a SIGKILL and the cgroup's `oom_kill` counter
rise: it reports `OOMKilled` with the limit and restarts the worker in place; at the third
kill it stops with the message that says what to change (exit 5), and `transom run` ends
the run with it instead of starting new generations. The cgroup is removed however the test
ends.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from transom import contract, defaults
from transom.launch import oom

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
LIMIT = 768 << 20  # the tiny GPT's run (runner, coordinator, launcher, worker) peaks near 520 MiB
ADVICE = "raise resources.limits.memory or lower the batch size"


def _kill_all(cgroup: Path) -> None:
    """SIGKILL what is left in the cgroup (the run's processes only: it is the test's own) and
    wait until it is empty, so that it can be removed."""
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        pids = [int(p) for p in (cgroup / "cgroup.procs").read_text().split()]
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"processes left in {cgroup}: {(cgroup / 'cgroup.procs').read_text().split()}")


@pytest.fixture(autouse=True)
def _fresh_workers(monkeypatch) -> None:
    """Workers started fresh, not from a warm interpreter: in a 768Mi container the warm
    interpreter (torch imported, some 800 MiB of RSS, most of it shared with the worker it
    forked) is as big as the worker, and the kernel may pick it as its victim first
    (docs/launcher.md); this test counts the kernel's kills of workers."""
    monkeypatch.setenv(contract.ENV_WARM_START, "0")


@pytest.fixture
def memory_cgroup() -> Iterator[oom.MemoryCgroup]:
    own = oom.find()
    if os.geteuid() != 0 or own is None or own.version != 1:
        pytest.skip("needs root and a cgroup v1 memory hierarchy with an oom_kill counter (kernel >= 4.13)")
    cgroup = oom.MemoryCgroup(own.path / f"transom-oom-test-{os.getpid()}", 1)
    cgroup.path.mkdir()
    try:
        (cgroup.path / "memory.limit_in_bytes").write_text(str(LIMIT))
        yield cgroup
    finally:
        try:
            _kill_all(cgroup.path)
        finally:
            cgroup.path.rmdir()


def _enter(cgroup: oom.MemoryCgroup):
    """A preexec_fn: the child (`transom run`, and so everything it starts) joins `cgroup`."""
    procs = str(cgroup.path / "cgroup.procs")
    return lambda: Path(procs).write_text(str(os.getpid()))


def test_a_worker_oomkilled_at_its_memory_limit_is_reported_and_restarted_in_place(transom_run, memory_cgroup):
    before = memory_cgroup.oom_kills()
    result = transom_run(["--replicas", "1", "--max-restarts", "3", "--inject", "oom:replica=0,step=3"],
                         ["--steps", "10"], timeout_s=180, preexec_fn=_enter(memory_cgroup))
    assert result.returncode == 0, result.output[-4000:]
    assert memory_cgroup.oom_kills() == before + 1  # the kernel's OOM killer, not a kill of ours
    assert "replica 0 attempt 0 failed: OOMKilled: worker rank 0 was OOMKilled (memory limit 768Mi)" in result.output
    assert "FAIL  replica 0: OOMKilled: worker rank 0 was OOMKilled (memory limit 768Mi)" in result.output
    s = result.summary
    assert s["completed_step"] == 10 and s["oom_killed"] is None
    # In place: attempts 0 and 1 of generation 0, no new generation.
    runs = sorted(p.name for p in result.stats_dir.glob("steps-r0-g*-a*.jsonl"))
    assert runs == ["steps-r0-g0-a0.jsonl", "steps-r0-g0-a1.jsonl"] and "starting generation" not in result.output


def test_repeated_oom_kills_end_the_run_with_what_to_change_not_a_crash_loop(transom_run, memory_cgroup):
    before = memory_cgroup.oom_kills()
    inject = ["--inject", "oom:replica=0,step=3"] * defaults.OOM_KILL_LIMIT
    t0 = time.monotonic()
    result = transom_run(["--replicas", "1", "--max-restarts", "10", *inject], ["--steps", "10"], timeout_s=180,
                         preexec_fn=_enter(memory_cgroup))
    assert result.returncode == contract.EXIT_OOM_KILLED, result.output[-4000:]
    assert memory_cgroup.oom_kills() == before + defaults.OOM_KILL_LIMIT
    message = f"OOMKilled: replica 0 was OOMKilled {defaults.OOM_KILL_LIMIT} times at memory limit 768Mi: {ADVICE}"
    assert result.summary["oom_killed"] == message and result.summary["completed_step"] is None
    assert f"{message}; stopping every replica" in result.output
    # Restarted in place until the limit (--max-restarts allowed more), never a new generation.
    assert result.incarnations(0) == defaults.OOM_KILL_LIMIT and "starting generation" not in result.output
    assert time.monotonic() - t0 < 120
