"""`transom launch` started by hand, as a pod runs it, against a coordinator the test owns.

For tests that need to do what `transom run` does not allow: restart the coordinator,
kill a whole launcher, run a spare launcher.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from transom import contract

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train_tiny_gpt.py"


def start_launcher(coordinator_url: str, token: str, num_replicas: int, stats_dir: Path, steps: int,
                   script: Path = EXAMPLE, args: tuple[str, ...] = (), output: Path | None = None,
                   **env: str) -> subprocess.Popen:
    """One single-process replica's launcher running `script` (the tiny GPT example) with
    `--steps steps` and `args`; `env` adds the replica's (or spare's) identity and settings.
    Output is captured (stdout, with stderr merged): piped, or into the file `output` (for a
    long run whose pipe nobody reads meanwhile)."""
    environ = dict(os.environ, OMP_NUM_THREADS="1", **{
        contract.ENV_NUM_REPLICAS: str(num_replicas),
        contract.ENV_COORDINATOR_URL: coordinator_url,
        contract.ENV_COORDINATOR_TOKEN: token,
        contract.ENV_STATS_DIR: str(stats_dir),
    }, **env)
    cmd = [sys.executable, "-m", "transom", "launch", "--nproc-per-node", "1", "--",
           sys.executable, str(script), "--steps", str(steps), *args]
    if output is None:
        return subprocess.Popen(cmd, env=environ, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with open(output, "w") as out:  # the child holds its own copy of the descriptor
        return subprocess.Popen(cmd, env=environ, stdout=out, stderr=subprocess.STDOUT, text=True)


def kill_all(launchers: list[subprocess.Popen]) -> None:
    """The end of a test: kill the launchers still running (their workers die with them)."""
    for p in launchers:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)
