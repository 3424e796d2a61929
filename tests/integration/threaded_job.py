"""A job whose replicas are threads of the test's own process, for the logic of fault
tolerance that needs no process of its own: detection and its verdicts, completion,
checkpoints and their resume, what failures cost. torchft's integration tests are the
model: replicas as threads, faults at a step, restarts in process.

Real: the coordinator (on loopback, through its HTTP API), the Gloo groups between the
threads, the trainer (`ft.FaultTolerant`) with its checkpoint engine, the detectors' rows
posted by the launcher's own `SignalForwarder`, and faults through the step hooks (each
replica's own TRANSOM_FAULT: the k-th fault for its k-th attempt, as `transom run --inject`
gives them). Standing in for the launcher: a replica whose body raises (a `raise` fault,
an eviction after a verdict) is restarted in place as its next attempt, a fresh model and
trainer on a new thread, unless it raised a ScriptError (which every attempt would
repeat). With `job`, the replicas' environment carries that job identity (the operator's
TRANSOM_JOB and TRANSOM_JOB_UID), which a checkpoint location records; without it, none
(nothing is claimed). No process starts, and so no `import torch` (2 s a process on the
2-core development machine) and no interpreter teardown.

What processes are for stays with `transom run` (conftest.py `transom_run`): SIGKILL and
SIGSTOP, OOM kills, orphans, partitions, pod termination, a coordinator restart, spares,
hangs (a thread cannot be killed), replicas of several ranks (one torch.distributed world
per process), and the launcher's and runner's own behaviour.

The result is the `RunResult` a `transom run` gives (run_result.py), its summary computed
by the same code from the same files, and its output the `transom` loggers' lines.
"""

from __future__ import annotations

import gc
import io
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from run_result import RunResult
from transom import contract
from transom.checkpoint.engine import CheckpointConfig
from transom.coordinator.client import CoordinatorClient
from transom.coordinator.membership import Settings
from transom.coordinator.models import Identity, JobStatus
from transom.coordinator.thread import CoordinatorThread
from transom.detect.step_rows import DetectionSettings
from transom.errors import ScriptError
from transom.ft import FaultTolerant, FTConfig
from transom.ft.replica import ReplicaContext
from transom.job_identity import JobIdentity
from transom.launch.end_on import Awaited, EndOn
from transom.launch.job_view import EventFeed
from transom.launch.signal_forwarder import LAST_FLUSH_PATIENCE_S, SignalForwarder
from transom.launch.summary import summarize

TOKEN = "threaded-job"
POLL_S = 0.05
Build = Callable[[int], tuple[torch.nn.Module, torch.optim.Optimizer]]
Body = Callable[[int, FaultTolerant, torch.nn.Module], Any]


@dataclass
class _Replica:
    """One replica id: its current attempt's thread and forwarder, and how its attempts ended."""

    rid: int
    faults: list[str]
    attempt: int = -1
    thread: threading.Thread | None = None
    trainer: FaultTolerant | None = None  # the current attempt's, once built
    forwarder: SignalForwarder | None = None
    result: Any = None
    errors: list[BaseException] = field(default_factory=list)
    finished: bool = False  # its last attempt's body returned
    gave_up: bool = False  # its last attempt failed, and it had no attempt left

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()


@dataclass
class ThreadedJob:
    """`replicas` threads running `body(replica, trainer, model)` on what `build(replica)`
    made, with a trainer of `config`, `checkpoint` and `trainer_kwargs` (per replica: a list),
    and `extra(optimizer)` as its extra_state (an LR scheduler of that replica's optimizer);
    `faults[replica]` are its TRANSOM_FAULT list; `attempts` per replica before the job fails;
    `restart_after`: a failed attempt is restarted only once the coordinator recorded an event
    of this kind (e.g. "paused": the test sees the job below minReplicas, whatever the timing).
    Its summary has `rounds` too: how many rounds the coordinator decided."""

    stats_dir: Path
    replicas: int
    body: Body
    build: Build
    min_replicas: int | None = None
    faults: dict[int, list[str]] = field(default_factory=dict)
    detection: dict | None = None
    checkpoint: CheckpointConfig | None = None
    config: FTConfig = field(default_factory=lambda: FTConfig(collective_timeout_s=10, quorum_timeout_s=30))
    trainer_kwargs: dict = field(default_factory=dict)
    extra: Callable[[torch.optim.Optimizer], Any] | None = None
    attempts: int = 4
    end_on: list[str] = field(default_factory=list)
    end_margin: int = 3
    restart_after: str | None = None
    timeout_s: float = 90
    job: JobIdentity | None = None  # the job identity in the replicas' environment
    lease_s: float | None = None  # the coordinator's quorum_lease_s (None: its default)

    def __post_init__(self) -> None:
        self.signals_dir = self.stats_dir / "signals"
        self.signals_dir.mkdir(parents=True, exist_ok=True)
        self._build_lock = threading.Lock()  # torch's seed is the process's: one model is built at a time
        self._detection = DetectionSettings.from_spec(json.dumps(self.detection) if self.detection else None)
        self._replicas = {r: _Replica(r, self.faults.get(r, [])) for r in range(self.replicas)}
        self._end = EndOn([Awaited.parse(a) for a in self.end_on], self.end_margin)
        self._feed = EventFeed()
        self._events: list[str] = []
        self._stores: list[object] = []  # the replicas' stores, released after their threads (_attempt)

    # --- one attempt of one replica ----------------------------------------------------------
    def _context(self, rep: _Replica, url: str) -> ReplicaContext:
        env = contract.ReplicaEnv.from_environ({
            contract.ENV_COORDINATOR_URL: url, contract.ENV_COORDINATOR_TOKEN: TOKEN,
            contract.ENV_REPLICA_ID: str(rep.rid), contract.ENV_NUM_REPLICAS: str(self.replicas),
            contract.ENV_ATTEMPT: str(rep.attempt), contract.ENV_FAULT: ";".join(rep.faults),
            **({contract.ENV_JOB: self.job.name, contract.ENV_JOB_UID: self.job.uid} if self.job else {})})
        return ReplicaContext(env=env, rank=0, local_rank=0, world_size=1, backend="gloo", device=torch.device("cpu"),
                              ctrl_group=None)

    def _attempt(self, rep: _Replica, ctx: ReplicaContext) -> None:
        with self._build_lock:
            model, optimizer = self.build(rep.rid)
        kwargs = {k: v[rep.rid] if isinstance(v, list) else v for k, v in self.trainer_kwargs.items()}
        if self.extra is not None:
            kwargs["extra_state"] = self.extra(optimizer)
        trainer = rep.trainer = FaultTolerant(model, optimizer, ctx, checkpoint=self.checkpoint, config=self.config,
                                              **kwargs)
        try:
            rep.result = self.body(rep.rid, trainer, model)
        finally:
            # torch 2.6 has aborted the process (1 run in about 6) when one replica's thread
            # destroyed its store's libuv server while another thread of the process was closing:
            # a process holds one replica in production; here the stores go once every thread ended.
            self._stores.append(trainer._store)
            trainer.close()  # a body that raised: the replica's failure, reported (the example's `finally:`)
        rep.finished = True

    def _start(self, rep: _Replica, url: str, client: CoordinatorClient) -> None:
        """The replica's next attempt, on a new thread, with the forwarder its launcher would run."""
        rep.attempt += 1
        rep.forwarder = SignalForwarder(self.signals_dir, Identity(replica_id=rep.rid, generation=0,
                                                                   attempt=rep.attempt),
                                        0, [0], client, self._detection)
        ctx = self._context(rep, url)

        def run() -> None:
            try:
                self._attempt(rep, ctx)
            except BaseException as e:  # noqa: BLE001 - the attempt's end, told to the job
                rep.errors.append(e)

        rep.thread = threading.Thread(target=run, name=f"replica-{rep.rid}-a{rep.attempt}", daemon=True)
        rep.thread.start()

    def _end_attempt(self, rep: _Replica) -> None:
        """What its launcher does once an attempt's worker is gone: post its last rows."""
        if rep.forwarder is not None:
            rep.forwarder.poll(time.monotonic())
            rep.forwarder.flush(patience_s=LAST_FLUSH_PATIENCE_S)
            rep.forwarder = None

    # --- the job -----------------------------------------------------------------------------------
    def _tend(self, url: str, client: CoordinatorClient) -> bool:
        """One pass: forward rows, restart failed attempts. False once no replica runs: by
        what this pass saw of each, never by a second look (a thread that ended between the two
        would end the job without the restart the next pass gives it)."""
        now = time.monotonic()
        busy = False
        for rep in self._replicas.values():
            if rep.running:
                busy = True
                if rep.forwarder is not None:
                    rep.forwarder.poll(now)
                continue
            self._end_attempt(rep)
            if rep.finished or rep.gave_up:
                continue
            if rep.errors and isinstance(rep.errors[-1], ScriptError):
                rep.gave_up = True  # as its launcher: every retry would fail alike
                continue
            if rep.attempt + 1 >= self.attempts:
                rep.gave_up = True  # the others go on without it, as far as they can
                continue
            if self.restart_after is not None and not any(e.startswith(f"{self.restart_after}:") for e in self._events):
                continue
            self._start(rep, url, client)
            busy = True
        return busy

    def _stop(self) -> None:
        """A job given up on: close the trainers still running (their coordinator calls stop at
        the next retry, their steps fail) and wait for their threads."""
        for rep in self._replicas.values():
            if rep.running and rep.trainer is not None:
                rep.trainer.close()
        for rep in self._replicas.values():
            if rep.thread is not None:
                rep.thread.join(timeout=2 * self.config.collective_timeout_s)
        left = [rep.rid for rep in self._replicas.values() if rep.running]
        assert not left, f"replica threads {left} still run after the job was stopped"

    def _watch(self, client: CoordinatorClient) -> None:
        """The events: kept for the summary, and --end-on's (it ends the job after them)."""
        status = client.status(timeout_s=5)
        fresh = self._feed.new(status.events)
        self._events += [f"{e.kind}: {e.message}" for e in fresh]
        self._end.watch(fresh, status.max_step, client.finish)

    def run(self) -> RunResult:
        settings = Settings(job="threaded", num_replicas=self.replicas, min_replicas=self.min_replicas or 1,
                            **({} if self.lease_s is None else {"quorum_lease_s": self.lease_s}))
        coordinator = CoordinatorThread(settings, TOKEN, detection=self._detection)
        url = coordinator.start()
        client = CoordinatorClient(url, TOKEN, timeout_s=5)
        output, t0 = _Captured(), time.monotonic()
        try:
            with output:
                for rep in self._replicas.values():
                    self._start(rep, url, client)
                while self._tend(url, client):
                    if time.monotonic() - t0 > self.timeout_s:
                        raise AssertionError(f"the threaded job did not end within {self.timeout_s}s: "
                                             f"{self._describe()}\n{output.text()[-3000:]}")
                    self._watch(client)
                    time.sleep(POLL_S)
                self._watch(client)
                status = client.status(timeout_s=5)
        finally:
            try:
                self._stop()
            finally:
                coordinator.stop()
                self._release_stores()
        return self._result(status, output.text(), time.monotonic() - t0)

    def _release_stores(self) -> None:
        """The stores go here, on the test's thread, while no thread of this job runs. A store
        lives as long as the process groups built on it, and those as long as their trainer,
        which reference cycles hold: left to a later garbage collection, they would go on
        whatever thread allocates then (a later job's checkpoint thread inside torch.save, while
        its replicas' threads close their own stores: the torch 2.6 abort `_attempt` speaks of).
        So the trainers are dropped and collected now."""
        for rep in self._replicas.values():
            rep.trainer = None
        self._stores.clear()
        gc.collect()

    def _result(self, status: JobStatus, output: str, wall_s: float) -> RunResult:
        summary = summarize(self.stats_dir, self.replicas, {r: len(f) for r, f in self.faults.items()}, wall_s)
        summary.update(completed_step=status.completed_step, last_checkpoint=status.last_checkpoint,
                       events=self._events,
                       duplicate_data=status.duplicate_data.model_dump() if status.duplicate_data else None,
                       diverged=status.diverged, rounds=status.round + 1)  # rounds: the coordinator decided
        if self.end_on:
            summary["end_on"] = self._end.summary()
        errors = [f"replica {r.rid}: {type(e).__name__}: {e}" for r in self._replicas.values() for e in r.errors]
        ok = all(r.finished for r in self._replicas.values()) and status.completed_step is not None \
            and status.diverged is None  # as `transom run`: a job that ended diverged failed
        if not ok:  # where each replica's attempts ended, for the failure's message
            errors.append(self._describe() + "; " + ", ".join(f"replica {r.rid} gave up" for r in
                                                               self._replicas.values() if r.gave_up))
        return RunResult(0 if ok else 1, summary, output + "".join(f"\n{line}" for line in errors), self.stats_dir,
                         results={r: rep.result for r, rep in self._replicas.items()})

    def _describe(self) -> str:
        return "; ".join(f"replica {r.rid} attempt {r.attempt} {'finished' if r.finished else 'running'} "
                         f"errors {[type(e).__name__ for e in r.errors]}" for r in self._replicas.values())


class _Captured:
    """The `transom` loggers' lines (INFO and up) while the job runs: its output."""

    def __init__(self) -> None:
        self._buffer = io.StringIO()
        self._handler = logging.StreamHandler(self._buffer)
        self._handler.setFormatter(logging.Formatter("%(name)s %(levelname)s %(message)s"))
        self._logger = logging.getLogger("transom")

    def __enter__(self) -> _Captured:
        self._level = self._logger.level
        self._logger.addHandler(self._handler)
        self._logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc: object) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)

    def text(self) -> str:
        return self._buffer.getvalue()


# --- the tiny GPT of examples/train_tiny_gpt.py, as a threaded job's replicas train it ------------------------------
def _example():
    import sys

    examples = str(Path(__file__).resolve().parents[2] / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import train_tiny_gpt

    return train_tiny_gpt


@dataclass(frozen=True)
class TinyGPT:
    """The example's model, smaller by default (what these tests check does not need its size),
    its data, and the loop of its `main()`."""

    dim: int = 32
    layers: int = 1
    context: int = 32
    batch_size: int = 8
    lr: float = 3e-3

    def build(self, replica: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        tg = _example()
        torch.manual_seed(0)  # the same weights on every replica (ThreadedJob builds one at a time)
        model = tg.TinyGPT(len(_chars()), dim=self.dim, layers=self.layers, context=self.context)
        return model, torch.optim.AdamW(model.parameters(), lr=self.lr)

    def steps(self, num_steps: int) -> Body:
        """A body that trains to `num_steps` as the example does; it returns the checkpoint
        step the trainer restored (None: none) and its last loss. With a scheduler as the
        trainer's extra_state (`schedule`), it steps it after every committed step, as the
        documented loop does."""
        tg, data = _example(), _data()

        def body(replica: int, trainer: FaultTolerant, model: torch.nn.Module) -> dict:
            loss = None
            for step in trainer.steps(num_steps):
                x, y = tg.batch(data, step, replica, 0, 1, self.batch_size, self.context)
                loss = model(x, y)
                loss.backward()
                trainer.finish_step(loss)
                if trainer.last_step_committed and trainer.extra_state is not None:
                    trainer.extra_state.step()
            return {"restored_step": trainer.restored_step, "loss": None if loss is None else loss.item()}

        return body

    @staticmethod
    def schedule(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        """A learning rate that changes at every step (warmup, then decay), so that a schedule
        one step off changes the weights."""
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 8) * 0.97 ** s)


_CORPUS: dict[str, Any] = {}


def _chars() -> list[str]:
    if "chars" not in _CORPUS:
        text = _example().make_corpus()
        _CORPUS["chars"] = sorted(set(text))
        _CORPUS["data"] = torch.tensor([_CORPUS["chars"].index(c) for c in text], dtype=torch.long)
    return _CORPUS["chars"]


def _data() -> torch.Tensor:
    _chars()
    return _CORPUS["data"]
