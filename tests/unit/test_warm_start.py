"""Which commands a warm interpreter can run, and the adopted worker's Popen-like interface."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from transom import contract
from transom.launch import warm_start
from transom.launch.warm_start import AdoptedProcess, Target, target_of


@pytest.mark.parametrize(("command", "expected"), [
    (["python", "train.py", "--steps", "3"], Target("python", "train.py", False, ("--steps", "3"))),
    (["/venv/bin/python3.11", "t.py"], Target("/venv/bin/python3.11", "t.py", False, ())),
    (["python3", "-m", "pkg.train", "-x"], Target("python3", "pkg.train", True, ("-x",))),
])
def test_a_python_script_or_module_is_run_warm(command, expected):
    assert target_of(command) == expected


@pytest.mark.parametrize("command", [
    ["python"],  # an interactive interpreter
    ["python", "-u", "train.py"],  # an option of the interpreter's: it changes how it starts
    ["python", "-c", "print(1)"],
    ["python", "-m"],
    ["torchrun", "--nproc-per-node", "2", "train.py"],
    ["bash", "-c", "python train.py"],
    ["pythonic-tool", "train.py"],
])
def test_anything_else_starts_fresh(command):
    assert target_of(command) is None


def test_warm_starts_are_on_unless_the_pod_environment_says_0():
    assert warm_start.enabled({})
    assert warm_start.enabled({contract.ENV_WARM_START: "1"})
    assert not warm_start.enabled({contract.ENV_WARM_START: "0"})


def test_an_interpreter_serves_the_same_python_and_environment_but_for_transoms_own_variables():
    interpreter = object.__new__(warm_start.WarmInterpreter)  # its state only: no process
    interpreter.target, interpreter.environ = Target("python", "t.py", False, ()), {"A": "1", "TRANSOM_REPLICA_ID": "0"}
    assert interpreter.serves(Target("python", "t.py", False, ()), {"A": "1", "TRANSOM_REPLICA_ID": "2"})
    assert not interpreter.serves(Target("python", "t.py", False, ()), {"A": "2", "TRANSOM_REPLICA_ID": "0"})
    assert not interpreter.serves(Target("python3", "t.py", False, ()), {"A": "1", "TRANSOM_REPLICA_ID": "0"})


def _child(code: int | None) -> int:
    pid = os.fork()
    if pid == 0:
        if code is None:
            time.sleep(60)
        os._exit(code or 0)
    return pid


def test_an_adopted_process_reports_its_exit_as_popen_does():
    done = AdoptedProcess(_child(3), ["python", "t.py"])
    assert done.wait(timeout=10) == 3 and done.poll() == 3 and done.returncode == 3
    running = AdoptedProcess(_child(None), ["python", "t.py"])
    try:
        assert running.poll() is None
        with pytest.raises(subprocess.TimeoutExpired):
            running.wait(timeout=0.05)
    finally:
        os.kill(running.pid, signal.SIGKILL)
    assert running.wait(timeout=10) == -signal.SIGKILL  # a signal's exit: negative, as Popen's
