"""Workers started from a warm interpreter: a restart that does not import torch again.

Every worker of a Python training script imports torch before its first step (about 3 s of
CPU here, much more from a network file system), and a restarted replica's workers do it
again while the other replicas train on. When the command is `python SCRIPT ...` or
`python -m MODULE ...`, the launcher keeps one interpreter of that Python with torch
imported (launch/warm_interpreter.py) and has it fork each worker: the worker runs the
script as `python SCRIPT` would, with the worker's environment, and is the launcher's child
(re-parented to it, its child subreaper), so it is waited for, signalled and stopped like
one the launcher started itself (`AdoptedProcess` has the part of Popen's interface the
launcher uses).

Anything else (a shell, `torchrun`, Python with options) is started as before, as is every
worker when `TRANSOM_WARM_START=0` is set, when the warm interpreter cannot start (another
Python without transom, no subreaper) or when it fails: it is then closed and the workers
start fresh, with a warning. An interpreter warmed under another environment is replaced
before use (an environment variable may change what an import does), except for Transom's
own variables, which only the workers read.
"""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass

from transom import contract
from transom.errors import WarmStartFailed
from transom.launch import processes

log = logging.getLogger("transom.launch")

READY_TIMEOUT_S = 120.0  # its imports: seconds here, a minute from a slow shared file system
ANSWER_TIMEOUT_S = 30.0  # two forks
CLOSE_GRACE_S = 1.0  # to exit on its own once its channel is closed
CLOSE_TIMEOUT_S = 5.0
_PYTHON = re.compile(r"python[0-9.]*$")


@dataclass(frozen=True)
class Target:
    """What a `python SCRIPT ARGS` or `python -m MODULE ARGS` command runs."""

    python: str
    target: str
    module: bool
    args: tuple[str, ...]


def target_of(command: list[str]) -> Target | None:
    """The command's Python target; None for a command a warm interpreter cannot run as it
    would run (not Python, or Python with options of its own)."""
    if len(command) < 2 or not _PYTHON.match(os.path.basename(command[0])):
        return None
    if command[1] == "-m" and len(command) >= 3 and not command[2].startswith("-"):
        return Target(command[0], command[2], True, tuple(command[3:]))
    if command[1].startswith("-"):
        return None
    return Target(command[0], command[1], False, tuple(command[2:]))


def enabled(environ: Mapping[str, str]) -> bool:
    return environ.get(contract.ENV_WARM_START, "1") != "0"


class AdoptedProcess:
    """A worker the warm interpreter forked and this process adopted: Popen's `pid`, `args`,
    `returncode`, `poll()` and `wait()`."""

    def __init__(self, pid: int, args: list[str]):
        self.pid = pid
        self.args = args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: only a sweep after it ended does that
                self.returncode = -signal.SIGKILL
                return self.returncode
            if pid != 0:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


def _alike(a: Mapping[str, str], b: Mapping[str, str]) -> bool:
    """The same environment for an import: equal but for Transom's own variables."""
    def outside(env: Mapping[str, str]) -> dict[str, str]:
        return {k: v for k, v in env.items() if not k.startswith("TRANSOM_")}
    return outside(a) == outside(b)


class WarmInterpreter:
    """One warm interpreter of `target.python`, started with `environ`; `close()` stops it."""

    def __init__(self, target: Target, environ: Mapping[str, str]):
        self.target = target
        self.environ = dict(environ)
        self._ready = False
        self._buffer = b""
        requests_r, self._requests = os.pipe()
        self._answers, answers_w = os.pipe()
        try:
            self.proc = subprocess.Popen(
                [target.python, "-m", "transom.launch.warm_interpreter", str(requests_r), str(answers_w),
                 str(os.getpid())],
                env=self.environ, pass_fds=(requests_r, answers_w), start_new_session=True,
                preexec_fn=processes.dies_with_parent())
        finally:
            os.close(requests_r)
            os.close(answers_w)

    def serves(self, target: Target, environ: Mapping[str, str]) -> bool:
        return self.target.python == target.python and _alike(self.environ, environ)

    def spawn(self, env: Mapping[str, str]) -> AdoptedProcess:
        """Fork a worker with environment `env`; WarmStartFailed if that cannot be done."""
        if not self._ready:  # its first answer says whether its imports went well
            answer = self._answer(READY_TIMEOUT_S)
            if not answer.get("ready"):
                raise WarmStartFailed(f"the warm interpreter did not start: {answer.get('why')}")
            self._ready = True
            log.info("warm interpreter ready (%s imported)", ", ".join(answer.get("modules", [])) or "nothing")
        t = self.target
        request = {"env": dict(env), "cwd": os.getcwd(), "target": t.target, "module": t.module,
                   "args": list(t.args), "death_signal": int(signal.SIGKILL)}
        try:
            os.write(self._requests, (json.dumps(request) + "\n").encode())
        except OSError as e:
            raise WarmStartFailed(f"the warm interpreter is gone ({e})") from e
        pid = self._answer(ANSWER_TIMEOUT_S).get("pid")
        if not isinstance(pid, int) or pid <= 0:
            raise WarmStartFailed(f"the warm interpreter answered no worker: {pid!r}")
        return AdoptedProcess(pid, [t.python, *(("-m",) if t.module else ()), t.target, *t.args])

    def _answer(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._answers], [], [], left)[0]:
                raise WarmStartFailed(f"the warm interpreter did not answer within {timeout_s:.0f}s")
            chunk = os.read(self._answers, 65536)
            if not chunk:
                raise WarmStartFailed(f"the warm interpreter exited (code {self.proc.poll()})")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        return json.loads(line)

    def close(self) -> None:
        """Close its channel (it exits on its own) and make sure it is gone."""
        for fd in (self._requests, self._answers):
            try:
                os.close(fd)
            except OSError:
                pass
        try:
            self.proc.wait(timeout=CLOSE_GRACE_S)
        except subprocess.TimeoutExpired:  # still importing: it reads no request before that
            self.proc.kill()
            self.proc.wait(timeout=CLOSE_TIMEOUT_S)
