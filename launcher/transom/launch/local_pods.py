"""The pods of `transom run`: each replica's and spare's `transom launch`, started as the
kubelet would start its pod.

A launcher gets what its pod would hold: the job's environment (contract.ENV_*, with the
run's job name and job_identity.LOCAL_UID as the job's identity), a replica
key of its own in a file (a pod's projected ServiceAccount token; coordinator/identity.py),
a termination log (the container's termination message), and for a spare a downward-API
labels file that names its replica once it is promoted (launch/spare.py). With a log
directory each replica's launcher and workers write to one file there, appended to by every
incarnation; a spare has a file of its own, which stays the log of the replica it takes over.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from transom import contract, script_errors
from transom.coordinator.identity import ReplicaKeys
from transom.job_identity import LOCAL_UID
from transom.launch.config import RunConfig


class LocalPods:
    """Starts the launchers of one local run and keeps what their pods would hold: keys,
    labels files, termination logs, log files. `close()` removes the keys."""

    def __init__(self, config: RunConfig, stats_dir: Path, log_dir: Path | None):
        self.config = config
        self.stats_dir = stats_dir
        self.log_dir = log_dir
        self.coordinator_url = ""  # set once the coordinator listens
        # Each launcher gets a key that speaks for its own replica only; the job's token stays
        # in the runner. The keys live in a directory of their own.
        self.keys = ReplicaKeys(config.job_name)
        self.peer_token = secrets.token_urlsafe(24)
        self.identity_dir = Path(tempfile.mkdtemp(prefix="transom-identity-"))
        self.logs: dict[int, str] = {}  # replica -> its log file
        self._log_files: list = []
        self._termination_logs: dict[subprocess.Popen, Path] = {}  # launcher -> its TRANSOM_TERMINATION_LOG

    def close(self) -> None:
        for f in self._log_files:
            f.close()
        shutil.rmtree(self.identity_dir, ignore_errors=True)

    # --- starting ----------------------------------------------------------------------------
    def start_replica(self, replica: int, generation: int, faults: list[str]) -> subprocess.Popen:
        env = self._pod_env(replica)
        env[contract.ENV_REPLICA_ID] = str(replica)
        env[contract.ENV_REPLICA_GENERATION] = str(generation)
        key_file = self.identity_dir / f"replica-{replica}-g{generation}"
        self.write_key(key_file, replica, generation)
        env[contract.ENV_IDENTITY_TOKEN_FILE] = str(key_file)
        env[contract.ENV_FAULT] = ";".join(faults)
        return self._launch(env, replica)

    def start_spare(self, spare_id: int, generation: int) -> tuple[subprocess.Popen, Path]:
        """A spare's launcher, waiting for the labels file that names its replica; its podinfo dir."""
        podinfo = self.stats_dir / "podinfo" / f"spare-{spare_id}-g{generation}"
        podinfo.mkdir(parents=True)
        write_labels(podinfo, {contract.LABEL_JOB: self.config.job_name, contract.LABEL_SPARE: str(spare_id)})
        env = self._pod_env(self.config.replicas + spare_id)
        env[contract.ENV_SPARE_ID] = str(spare_id)
        env[contract.ENV_PODINFO_DIR] = str(podinfo)
        # Empty until promotion, as a spare pod's token names no replica until its relabel.
        env[contract.ENV_IDENTITY_TOKEN_FILE] = str(self.identity_dir / f"spare-{spare_id}-g{generation}")
        return self._launch(env, f"spare-{spare_id}-g{generation}"), podinfo

    def promote(self, spare: str, podinfo: Path, replica: int, generation: int) -> None:
        """Make the spare named `spare` (spare-K-gN) act as (`replica`, `generation`), as the
        operator's relabel does: its key first, then the labels that make it act as the replica."""
        self.write_key(self.identity_dir / spare, replica, generation)
        write_labels(podinfo, {contract.LABEL_JOB: self.config.job_name, contract.LABEL_REPLICA: str(replica),
                               contract.LABEL_GENERATION: str(generation)})
        if self.log_dir is not None:
            self.logs[replica] = str(self.log_dir / f"{spare}.log")

    def write_key(self, path: Path, replica: int, generation: int) -> None:
        """The replica key of (`replica`, `generation`) at `path`, readable by its owner only,
        replaced at once (a launcher reads it again when it changes)."""
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(self.keys.mint(replica, generation))
        tmp.rename(path)

    def job_error(self) -> tuple[int, str] | None:
        """(exit code, message) of a launcher, current or already replaced, that exited with
        EXIT_SCRIPT_ERROR or EXIT_OOM_KILLED: it ends the run (a replaced one too: its failure
        report may have made a spare take over before it exited)."""
        for proc, path in self._termination_logs.items():
            code = proc.poll()
            if code in (contract.EXIT_SCRIPT_ERROR, contract.EXIT_OOM_KILLED):
                return code, script_errors.read_termination_log(path) or f"launcher pid {proc.pid} gave no message"
        return None

    def termination_message(self, proc: subprocess.Popen) -> str | None:
        """What a launcher that ended wrote as its termination message (a pod's), if anything."""
        path = self._termination_logs.get(proc)
        return script_errors.read_termination_log(path) if path is not None else None

    # --- a pod's contents --------------------------------------------------------------------
    def _output_of(self, who: int | str):
        """Where a replica's launcher and workers write: its log file, or None for this terminal."""
        if self.log_dir is None:
            return None
        path = self.log_dir / (f"replica-{who}.log" if isinstance(who, int) else f"{who}.log")
        if isinstance(who, int):
            self.logs[who] = str(path)
        f = open(path, "ab")
        self._log_files.append(f)
        return f

    def _pod_env(self, slot: int) -> dict[str, str]:
        """What every launcher's pod environment holds; `slot` picks its GPUs (replica, then spare)."""
        config = self.config
        env = dict(os.environ)
        env.update(
            {
                # One job for every replica, spare and generation of this run (job_identity.py).
                contract.ENV_JOB: config.job_name,
                contract.ENV_JOB_UID: LOCAL_UID,
                contract.ENV_NAMESPACE: "local",
                contract.ENV_NUM_REPLICAS: str(config.replicas),
                contract.ENV_NODE_RANK: "0",
                contract.ENV_NNODES: "1",
                contract.ENV_NPROC_PER_NODE: str(config.nproc_per_replica),
                contract.ENV_COORDINATOR_URL: self.coordinator_url,
                contract.ENV_PEER_TOKEN: self.peer_token,
                contract.ENV_STATS_DIR: str(self.stats_dir),
                contract.ENV_SIGNALS_DIR: str(self.stats_dir / "signals"),
                contract.ENV_COLLECTIVE_TIMEOUT: str(config.collective_timeout_s),
                contract.ENV_BACKEND: config.backend,
                # One thread per worker: replicas share this machine's cores.
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
                contract.ENV_OWNER_PID: str(os.getpid()),  # the launcher stops if this process dies
            }
        )
        for var in (contract.ENV_REPLICA_ID, contract.ENV_REPLICA_GENERATION, contract.ENV_SPARE_ID,
                    contract.ENV_PODINFO_DIR, contract.ENV_FAULT, contract.ENV_COORDINATOR_TOKEN):
            env.pop(var, None)
        if (devices := config.devices[slot]) is not None:
            env["CUDA_VISIBLE_DEVICES"] = devices
        if config.detection:
            env[contract.ENV_DETECTION] = config.detection
        if config.preflight:
            env[contract.ENV_PREFLIGHT] = config.preflight
        if config.checkpoint_uri:
            env[contract.ENV_CHECKPOINT_URI] = config.checkpoint_uri
        for var, value in ((contract.ENV_CHECKPOINT_INTERVAL, config.checkpoint_interval),
                           (contract.ENV_CHECKPOINT_KEEP, config.checkpoint_keep)):
            if value is not None:
                env[var] = str(value)
        return env

    def _launch(self, env: dict[str, str], output_of: int | str) -> subprocess.Popen:
        cmd = [
            sys.executable, "-m", "transom", "launch",
            "--nproc-per-node", str(self.config.nproc_per_replica),
            "--max-restarts", str(self.config.max_restarts),
            "--", *self.config.command,
        ]
        out = self._output_of(output_of)
        termination_log = self.identity_dir / f"termination-{len(self._termination_logs)}"
        env[contract.ENV_TERMINATION_LOG] = str(termination_log)
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=out)
        self._termination_logs[proc] = termination_log
        return proc


def write_labels(directory: Path, labels: dict[str, str]) -> None:
    """A downward-API labels file, replaced at once (the kubelet swaps the volume's contents)."""
    tmp = directory / "labels.tmp"
    tmp.write_text("".join(f"{k}={json.dumps(v)}\n" for k, v in sorted(labels.items())))
    tmp.rename(directory / "labels")

