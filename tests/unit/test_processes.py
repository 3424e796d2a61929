"""The launcher's sweep of what left its workers' process groups (launch/processes.py), in a
process of its own: the sweep kills every descendant of the process that runs it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

import transom

pytestmark = [pytest.mark.timeout(30),
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER and /proc")]

# A daemon's double fork: the middle process exits at once, the grandchild (its command line
# ends with the marker argv[1]) leaves the group and sleeps.
SWEEPER = r'''
import json, os, subprocess, sys, time
from transom.launch import processes
adopted = processes.adopt_orphans()
daemon = "import os, time\nif os.fork() == 0:\n    os.setsid(); time.sleep(600)"
subprocess.run([sys.executable, "-c", daemon, sys.argv[1]], check=True, stdout=subprocess.DEVNULL,
               stderr=subprocess.DEVNULL)
deadline = time.monotonic() + 2
while not processes.descendants(os.getpid()) and time.monotonic() < deadline:
    time.sleep(0.01)
found = processes.descendants(os.getpid())
print(json.dumps({"adopted": adopted, "found": len(found), "swept": processes.kill_descendants(),
                  "left": len(processes.descendants(os.getpid()))}))
'''


def marked(marker: str) -> list[int]:
    """Processes whose command line holds `marker`."""
    out = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                out.append(int(entry.name))
        except OSError:
            continue
    return out


def test_a_daemonized_grandchild_is_adopted_killed_and_reaped():
    marker = f"transom-sweep-{uuid.uuid4().hex}"
    launcher = Path(transom.__file__).resolve().parents[1]
    try:
        out = subprocess.run([sys.executable, "-c", SWEEPER, marker], capture_output=True, text=True, timeout=20,
                             env=dict(os.environ, PYTHONPATH=str(launcher)))
        assert out.returncode == 0, out.stderr
        # adopted (re-parented to the sweeper, not to PID 1), killed, and reaped: not even a zombie is left
        assert json.loads(out.stdout) == {"adopted": True, "found": 1, "swept": True, "left": 0}
        assert marked(marker) == []
    finally:
        for pid in marked(marker):
            os.kill(pid, signal.SIGKILL)
