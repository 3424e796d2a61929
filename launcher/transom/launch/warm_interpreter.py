"""The warm interpreter: a Python process with torch already imported that forks the workers.

Started by the launcher with the workers' own interpreter (`python -m
transom.launch.warm_interpreter`) when the command is `python SCRIPT ...` or `python -m
MODULE ...` (launch/warm_start.py). It imports torch and `torch._dynamo` once (about 3 s of
CPU each time a worker would otherwise start: `torch._dynamo` comes with an optimizer's
first `add_param_group`), and then, for each worker the launcher asks for, forks a process
that runs the script as `__main__`, as `python SCRIPT` would. A restarted replica thus
starts training without importing torch again.

A worker is forked twice and the middle process exits at once, so the worker is re-parented
to the launcher (its child subreaper): it is the launcher's child like a worker it started
itself, which waits for it, reads its exit status and stops its process group. Nothing is
done here that cannot be done before a fork: CUDA is never touched (the workers initialise
it themselves), no thread is started, and the requests are JSON lines from the launcher,
never code. Pure standard library until the warm imports.
"""

from __future__ import annotations

import importlib
import json
import os
import random
import sys
import time
import warnings
from typing import Any

# What a training script imports anyway, in the order it would: torch, then what its first
# optimizer imports (`torch._dynamo`, which brings FSDP and the inductor's config with it).
WARM_MODULES = ("torch", "torch._dynamo")
# How long a new worker waits to be re-parented to the launcher (its middle process exits
# right after forking it: microseconds, unless the machine is starved).
REPARENT_TIMEOUT_S = 30.0
EXIT_NOT_ADOPTED = 70  # the launcher is gone before the worker became its child


def _warm_up() -> list[str]:
    """Import WARM_MODULES; the names imported. A module that fails to import is skipped:
    the worker then imports it itself, as it would have without a warm interpreter."""
    done = []
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:
            break
        done.append(name)
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        raise RuntimeError("CUDA was initialised by the warm imports: forking would break it in the workers")
    return done


def _fork() -> int:
    """os.fork, without Python 3.12's warning about a process with threads: the only other
    thread here is OpenBLAS's idle server (numpy, imported by torch), which stops itself
    across a fork (its pthread_atfork handler), as every DataLoader worker relies on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*fork.*", category=DeprecationWarning)
        return os.fork()


def _serve(requests: int, answers: int) -> dict[str, Any] | None:
    """Answer requests until the launcher closes its end; in a forked worker, its request."""
    reader = os.fdopen(requests, "r", encoding="utf-8")
    while line := reader.readline():
        request = json.loads(line)
        handoff_r, handoff_w = os.pipe()
        middle = _fork()
        if middle == 0:
            worker = _fork()
            if worker == 0:
                os.close(handoff_r)
                os.close(handoff_w)
                reader.close()
                os.close(answers)
                return request
            os.write(handoff_w, str(worker).encode())
            os._exit(0)
        os.close(handoff_w)
        with os.fdopen(handoff_r, "rb") as f:
            worker_pid = int(f.read() or b"0")
        os.waitpid(middle, 0)  # gone: the worker is re-parented to the launcher now
        os.write(answers, (json.dumps({"pid": worker_pid}) + "\n").encode())
    return None


def _name_process(name: str) -> None:
    """The name `ps -o comm`, top and /proc/PID/comm show (15 bytes at most): a forked worker's
    command line is still the warm interpreter's, so its name says which script it runs."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):  # not Linux: the name stays
        pass


def _become_worker(request: dict[str, Any], launcher: int) -> None:
    """In the forked worker: a process of its own, the launcher's child, with the worker's
    environment, directory and arguments."""
    from transom.launch import processes  # stdlib only

    os.setsid()  # its own session and process group, as a worker the launcher starts itself
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != launcher and time.monotonic() < deadline:
        time.sleep(0.001)
    if not processes.follow_parent(launcher, int(request.get("death_signal", 9))):
        os._exit(EXIT_NOT_ADOPTED)
    _name_process(os.path.basename(request["target"]) if not request["module"] else request["target"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    # A fresh process draws its own seeds; a fork would repeat the warm interpreter's.
    random.seed()  # (Python does this after a fork too; numpy's global state it does not)
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run(request: dict[str, Any]) -> None:
    """Run the worker's target as `__main__`, as `python SCRIPT ARGS` or `python -m MODULE ARGS`."""
    import runpy

    target, args = request["target"], request["args"]
    if request["module"]:
        sys.argv = [target, *args]  # runpy puts the module's file in argv[0]
        sys.path[0] = os.getcwd()
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [target, *args]
        sys.path[0] = os.path.dirname(os.path.abspath(target))
        runpy.run_path(target, run_name="__main__")


def main() -> None:
    requests, answers, launcher = (int(a) for a in sys.argv[1:4])
    _name_process("transom-warm")
    try:
        warmed = _warm_up()
    except Exception as e:
        os.write(answers, (json.dumps({"ready": False, "why": str(e)}) + "\n").encode())
        return
    os.write(answers, (json.dumps({"ready": True, "modules": warmed}) + "\n").encode())
    request = _serve(requests, answers)
    if request is None:  # the launcher closed the channel: nothing more to start
        os._exit(0)  # at once: tearing down torch's modules takes a second and serves nobody
    _become_worker(request, launcher)
    _run(request)


if __name__ == "__main__":
    main()
