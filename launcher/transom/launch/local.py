"""Local mode (`transom run`): a whole fault-tolerant job on one machine.

It starts a coordinator (in this process, on loopback) and one `transom launch` per
replica, each supervising `--nproc-per-replica` workers: exactly what each pod runs in
Kubernetes. The runner plays the operator's part where the launcher cannot: a launcher
that gives up (restarts exhausted) is started again as the replica's next generation.
It shows live progress (step, loss, healthy replicas, events) and ends with a summary.

Faults are injected with `--inject ACTION:replica=I,step=S[,rank=R][,phase=P]`
(see transom.inject); the k-th fault aimed at a replica fires in its k-th incarnation.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from transom import contract
from transom.coordinator.membership import Settings
from transom.coordinator.server import CoordinatorThread
from transom.launch.summary import summarize


@dataclass
class RunConfig:
    command: list[str]
    replicas: int
    nproc_per_replica: int = 1
    min_replicas: int = 1
    injects: list[tuple[int, str]] = field(default_factory=list)  # (replica, worker fault spec)
    summary_json: str | None = None
    stats_dir: str | None = None
    collective_timeout_s: float = 10.0
    heartbeat_timeout_s: float = 3.0
    max_restarts: int = 3
    max_generations: int = 3
    timeout_s: float = 3600.0
    quiet: bool = False
    checkpoint_uri: str = ""  # TRANSOM_CHECKPOINT_URI of the workers: a directory or s3://...
    checkpoint_interval: int | None = None
    checkpoint_keep: int | None = None

    def __post_init__(self) -> None:
        if not self.command:
            raise ValueError("a training command is required after --")
        if not 1 <= self.replicas <= 64:
            raise ValueError("--replicas must be between 1 and 64 in local mode")
        if not 1 <= self.min_replicas <= self.replicas:
            raise ValueError("--min-replicas must be between 1 and --replicas")
        for replica, _ in self.injects:
            if replica >= self.replicas:
                raise ValueError(f"--inject names replica {replica}, but there are only {self.replicas}")


class LocalRun:
    def __init__(self, config: RunConfig):
        self.config = config
        self.token = secrets.token_urlsafe(24)
        self._own_stats_dir = not config.stats_dir
        if config.stats_dir:
            self.stats_dir = Path(config.stats_dir)
            self.stats_dir.mkdir(parents=True, exist_ok=True)
        else:
            self.stats_dir = Path(tempfile.mkdtemp(prefix="transom-run-"))
        settings = Settings(
            job="local",
            num_replicas=config.replicas,
            min_replicas=config.min_replicas,
            heartbeat_interval_s=min(1.0, config.heartbeat_timeout_s / 3),
            heartbeat_timeout_s=config.heartbeat_timeout_s,
        )
        self.coordinator = CoordinatorThread(settings, self.token)
        self.launchers: dict[int, subprocess.Popen] = {}
        self.generation: dict[int, int] = {}
        self.done: set[int] = set()
        self.faults: dict[int, list[str]] = {}
        for replica, spec in config.injects:
            self.faults.setdefault(replica, []).append(spec)
        self._t0 = time.monotonic()
        self._events_shown = 0
        self._events: list[str] = []
        self._last_line = ""

    # --- output ------------------------------------------------------------------------------
    def say(self, text: str) -> None:
        if not self.config.quiet:
            print(f"[{time.monotonic() - self._t0:7.2f}s] {text}", flush=True)

    # --- replicas ----------------------------------------------------------------------------
    def _start(self, replica: int, generation: int) -> None:
        env = dict(os.environ)
        env.update(
            {
                contract.ENV_JOB: "local",
                contract.ENV_NAMESPACE: "local",
                contract.ENV_REPLICA_ID: str(replica),
                contract.ENV_NUM_REPLICAS: str(self.config.replicas),
                contract.ENV_REPLICA_GENERATION: str(generation),
                contract.ENV_NODE_RANK: "0",
                contract.ENV_NNODES: "1",
                contract.ENV_NPROC_PER_NODE: str(self.config.nproc_per_replica),
                contract.ENV_COORDINATOR_URL: self.coordinator.url,
                contract.ENV_COORDINATOR_TOKEN: self.token,
                contract.ENV_STATS_DIR: str(self.stats_dir),
                contract.ENV_COLLECTIVE_TIMEOUT: str(self.config.collective_timeout_s),
                # One thread per worker: replicas share this machine's cores.
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            }
        )
        if self.config.checkpoint_uri:
            env[contract.ENV_CHECKPOINT_URI] = self.config.checkpoint_uri
        for var, value in ((contract.ENV_CHECKPOINT_INTERVAL, self.config.checkpoint_interval),
                           (contract.ENV_CHECKPOINT_KEEP, self.config.checkpoint_keep)):
            if value is not None:
                env[var] = str(value)
        faults = self.faults.get(replica, []) if generation == 0 else []
        env[contract.ENV_FAULT] = ";".join(faults)
        cmd = [
            sys.executable, "-m", "transom", "launch",
            "--nproc-per-node", str(self.config.nproc_per_replica),
            "--max-restarts", str(self.config.max_restarts),
            "--", *self.config.command,
        ]
        self.launchers[replica] = subprocess.Popen(cmd, env=env)
        self.generation[replica] = generation

    def _show_progress(self) -> None:
        membership = self.coordinator.server.membership
        status, events, total = self.coordinator.call(
            lambda: (membership.status(time.monotonic()), list(membership.events), membership.events_total)
        )
        first = total - len(events)  # events is a bounded deque: global index of its head
        for i, ev in enumerate(events):
            if first + i >= self._events_shown:
                self.say(f"event  {ev.kind:10s} {ev.message}")
                self._events.append(f"{ev.kind}: {ev.message}")
        self._events_shown = total
        losses = [r.last_loss for r in status.replicas if r.last_loss is not None and r.state == "healthy"]
        loss = f"{sum(losses) / len(losses):.4f}" if losses else "-"
        line = (
            f"step {status.max_step:5d}  loss {loss}  healthy {status.healthy_replicas}/{status.num_replicas}"
            f"  quorum {status.quorum_id} {status.members}" + ("  PAUSED" if status.paused else "")
        )
        if line != self._last_line:
            self.say(line)
            self._last_line = line


    def _last_checkpoint(self) -> tuple[int, float] | None:
        membership = self.coordinator.server.membership
        try:
            return self.coordinator.call(lambda: membership.last_checkpoint)
        except Exception:  # the coordinator is gone: the summary says "unknown"
            return None

    # --- main ----------------------------------------------------------------------------------
    def run(self) -> int:
        self.coordinator.start()
        self.say(
            f"coordinator at {self.coordinator.url}; {self.config.replicas} replicas x "
            f"{self.config.nproc_per_replica} processes; injecting {sum(map(len, self.faults.values()))} fault(s)"
        )
        exit_code = 0
        try:
            for r in range(self.config.replicas):
                self._start(r, 0)
            deadline = self._t0 + self.config.timeout_s
            next_show = 0.0
            while len(self.done) < self.config.replicas:
                if time.monotonic() > deadline:
                    self.say(f"timed out after {self.config.timeout_s:.0f}s")
                    exit_code = 1
                    break
                for r, proc in list(self.launchers.items()):
                    code = proc.poll()
                    if code is None or r in self.done:
                        continue
                    if code == 0:
                        self.done.add(r)
                        continue
                    gen = self.generation[r] + 1
                    if gen >= self.config.max_generations:
                        self.say(f"replica {r} failed {gen} generations; giving up")
                        exit_code = 1
                        break
                    self.say(f"replica {r} launcher exited with {code}; starting generation {gen}")
                    self._start(r, gen)
                if exit_code:
                    break
                if time.monotonic() >= next_show:
                    self._show_progress()
                    next_show = time.monotonic() + 0.5
                time.sleep(0.05)
            self._show_progress()
        finally:
            for proc in self.launchers.values():
                if proc.poll() is None:
                    proc.terminate()
            for proc in self.launchers.values():
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
            last_checkpoint = self._last_checkpoint()
            self.coordinator.stop()
        summary = summarize(
            self.stats_dir, self.config.replicas, {r: len(f) for r, f in self.faults.items()},
            time.monotonic() - self._t0,
        )
        summary["exit_code"] = exit_code
        summary["last_checkpoint"] = last_checkpoint[0] if last_checkpoint else None
        if self._own_stats_dir:
            shutil.rmtree(self.stats_dir, ignore_errors=True)
        summary["events"] = self._events
        self.say("summary " + json.dumps({k: v for k, v in summary.items() if k != "events"}))
        if self.config.summary_json:
            Path(self.config.summary_json).write_text(json.dumps(summary, indent=2) + "\n")
        return exit_code
