"""The checkpoint engine: a snapshot in the training loop, everything else in the background.

    engine = CheckpointEngine(CheckpointConfig.from_environ(interval_steps=200, keep=2))
    ...
    optimizer.step()
    if engine.due(step):
        engine.save(step, {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, slot, attempt)
    ...                         # next forward/backward: the copy runs meanwhile
    engine.wait_snapshot()      # before the next optimizer.step()
    ...
    engine.close()

`FaultTolerant` does this for a training script (ft/checkpointing.py); `slot` says which
part of the checkpoint this process writes (layout.Slot), and `attempt` is an id that every
writer of this checkpoint shares and no other attempt at the same step uses (FaultTolerant
uses the quorum round in which the step was committed).

`save` flattens the state (structure.py; DTensors become their local parts, sharding.py),
starts the copy of this process's part into reusable host buffers (snapshot.py) and
returns; the stall is that call plus whatever `wait_snapshot` still has to wait. One
background thread, owned by the engine and stopped by `close()`, then writes the part,
and (on part 0's writer) commits the step, prunes old checkpoints and reports the
committed step (`on_commit`, which FaultTolerant points at the coordinator).

Policy when a checkpoint comes due while the previous one is still persisting: it is
skipped (counted in `skipped`, logged). Host memory stays at one copy of the state, and a
storage outage cannot pile up snapshots; the checkpoint after the outage is the newest
state anyway. The skipping writer leaves a `skipped` marker in its part once it is free, so
the committer of that step stops waiting for it. Storage errors are retried with backoff
for as long as the engine runs and never reach the training loop.

Fencing: with a `fence` (FaultTolerant gives the replica's, ft/fencing.py), every object
the thread writes or deletes is confirmed first: `fence(action, what)` returns if this
incarnation is still the replica's current one, raises `Fenced` if it is not (nothing more
of this checkpoint is written, one line says so), and raises another error if it cannot
tell now (the coordinator is away: nothing is written and the write is retried like a
storage error). Without a fence (the engine used on its own) nothing is asked.
`before_persist(step)` runs in the thread before the first object of each checkpoint
(fault injection: a process stopped in the middle of a checkpoint, transom/inject.py).
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from transom import contract, defaults
from transom.checkpoint import blob, layout, sharding, structure
from transom.checkpoint.persist import commit, mark_skipped, write_part
from transom.checkpoint.restore import committed_steps
from transom.checkpoint.snapshot import Snapshot
from transom.checkpoint.storage import Storage, retry
from transom.errors import Diverged, Fenced, UsageError

log = logging.getLogger("transom.checkpoint")
T = TypeVar("T")


@dataclass(frozen=True)
class CheckpointConfig:
    uri: str
    interval_steps: int = 0  # 0: only when save() is called
    keep: int = 2
    # The waits: what each bounds is said in defaults.py.
    commit_timeout_s: float = defaults.CHECKPOINT_COMMIT_TIMEOUT_S
    snapshot_timeout_s: float = defaults.CHECKPOINT_SNAPSHOT_TIMEOUT_S
    save_on_close: bool = True  # FaultTolerant.close() saves the final step
    close_timeout_s: float = defaults.CHECKPOINT_CLOSE_TIMEOUT_S
    restore_timeout_s: float = defaults.CHECKPOINT_RESTORE_TIMEOUT_S
    retry_first_s: float = defaults.CHECKPOINT_RETRY_FIRST_S
    retry_max_s: float = defaults.CHECKPOINT_RETRY_MAX_S
    storage_options: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.uri:
            raise ValueError("checkpoint uri must not be empty")
        if self.interval_steps < 0 or self.keep < 1:
            raise ValueError("interval_steps must be >= 0 and keep >= 1")
        for name in ("commit_timeout_s", "snapshot_timeout_s", "close_timeout_s", "restore_timeout_s",
                     "retry_first_s", "retry_max_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")

    @classmethod
    def from_environ(cls, **overrides: Any) -> CheckpointConfig | None:
        """From the pod environment (the operator sets it from spec.checkpoint); None without a URI.

        Arguments that are not None win over TRANSOM_CHECKPOINT_URI, _INTERVAL_STEPS and _KEEP.
        """
        values: dict[str, Any] = {"uri": os.environ.get(contract.ENV_CHECKPOINT_URI, "")}
        for name, var in (("interval_steps", contract.ENV_CHECKPOINT_INTERVAL), ("keep", contract.ENV_CHECKPOINT_KEEP)):
            if raw := os.environ.get(var):
                try:
                    values[name] = int(raw)
                except ValueError:
                    raise ValueError(f"{var} must be an integer, got {raw!r}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values) if values["uri"] else None


@dataclass
class _Job:
    step: int
    attempt: str
    slot: layout.Slot
    entries: list[layout.Entry]  # of this process's part
    skeleton: Any  # the shard's skeleton if this is its first writer, else None
    digest: torch.Tensor | None = None  # the state's fingerprint (0-dim, maybe on the device)


class CheckpointEngine:
    def __init__(self, config: CheckpointConfig, on_commit: Callable[[int, str], None] | None = None,
                 fence: Callable[[str, str], None] | None = None,
                 before_persist: Callable[[int], None] | None = None):
        self.config = config
        self.storage = Storage(config.uri, **config.storage_options)
        if fence is not None:
            self.storage.guard = lambda path, deleting: fence("delete" if deleting else "write", layout.describe(path))
        self.on_commit = on_commit
        self.before_persist = before_persist
        self._snapshot = Snapshot()
        self._job: _Job | None = None
        self._skips: list[tuple[int, str, int]] = []  # (step, attempt, part) skipped while busy: markers to write
        self._closing = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="transom-checkpoint", daemon=True)
        self._thread.start()
        # Figures for the caller and the benchmark.
        self.committed_step: int | None = None
        self.skipped = 0
        self.failed = 0
        self.fenced = 0  # checkpoints stopped because this incarnation was no longer current
        self.last_stall_s = 0.0
        self.last_persist_s = 0.0
        self._trouble: str | None = None
        self.on_trouble: Callable[[str | None], None] | None = None  # told when `trouble` changes (its thread)

    def _say(self, trouble: str | None) -> None:
        changed = trouble != self._trouble
        self._trouble = trouble
        if changed and self.on_trouble is not None:
            self.on_trouble(trouble)

    @property
    def trouble(self) -> str | None:
        """While the storage fails and a retry waits: the last failure, as "writing part 0 of
        step 40: ConnectionError"; None once a write goes through again. The replica's
        heartbeats carry it to the coordinator, which names it in the job's status."""
        return self._trouble

    def due(self, step: int) -> bool:
        return self.config.interval_steps > 0 and step > 0 and step % self.config.interval_steps == 0

    # --- the training loop's side -----------------------------------------------------------
    def save(self, step: int, state: Any, slot: layout.Slot = layout.Slot(), attempt: str | None = None,
             digest: torch.Tensor | None = None) -> bool:
        """Snapshot `state` as checkpoint `step`; this process writes the part `slot` names.
        `digest`: the fingerprint of the state's parameters and optimizer state, which every
        writer of the same shard must have alike (read in the background, after the snapshot).

        `attempt`: the id every writer of this checkpoint shares (a fresh one by default,
        which only works for a single writer). Returns False (and writes nothing) if the
        previous checkpoint is still persisting.
        """
        if attempt is None:
            if slot.writers > 1:
                raise ValueError("the writers of one checkpoint must pass the attempt id they share")
            attempt = uuid.uuid4().hex
        t0 = time.monotonic()
        with self._cond:
            if self._closing:
                raise UsageError("the checkpoint engine is closed")
            if self._job is not None:
                self.skipped += 1
                self._skips.append((step, attempt, slot.part))
                log.warning("checkpoint of step %d skipped: step %d is still persisting", step, self._job.step)
                return False
        prefix = layout.shard_prefix(slot.shard, slot.shards)
        tensors, skeleton = structure.flatten(state, torch.is_tensor, sharding.localize, prefix)
        skeleton = json.loads(json.dumps(skeleton))  # a deep copy, and a clear error if not JSON
        sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
        parts = layout.partition(sizes, slot.writers)
        mine = {k: t for k, t in tensors.items() if parts[k] == slot.writer}
        self._snapshot.start(mine)
        entries = [layout.Entry(key=k, dtype=blob.dtype_name(t.dtype), shape=list(t.shape), nbytes=sizes[k], crc32=0,
                                part=slot.part, shard=slot.shard) for k, t in mine.items()]
        with self._cond:
            self._job = _Job(step, attempt, slot, entries, skeleton if slot.writer == 0 else None, digest)
            self._cond.notify_all()
        self.last_stall_s = time.monotonic() - t0
        return True

    def wait_snapshot(self) -> float:
        """Block until the host copy is complete (call before optimizer.step()); returns seconds waited."""
        t0 = time.monotonic()
        if self._snapshot.busy:
            self._snapshot.wait(self.config.snapshot_timeout_s)
        waited = time.monotonic() - t0
        self.last_stall_s += waited
        return waited

    def wait_persisted(self, timeout_s: float) -> bool:
        """Block until no checkpoint is in flight; False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._job is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        """Finish the checkpoint in flight (up to timeout_s), then stop the background thread."""
        self.wait_persisted(timeout_s)
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=max(1.0, timeout_s))

    # --- the background side ------------------------------------------------------------------
    def _stopped(self) -> bool:
        return self._closing

    def _run(self) -> None:
        while True:
            with self._cond:
                while self._job is None and not self._closing:
                    self._cond.wait()
                if self._closing:
                    return
                job = self._job
            assert job is not None
            t0 = time.monotonic()
            try:
                self._persist(job)
            except Fenced as e:  # replaced meanwhile: nothing more of this checkpoint may reach storage
                self.fenced += 1
                log.error("%s", e)
            except Diverged as e:  # the writers' states differ: no checkpoint is assembled from them
                self.failed += 1
                self._say(str(e)[:300])  # the heartbeats carry it to status (checkpointTrouble)
                log.error("%s", e)
            except Exception as e:  # closing mid-retry, or a bug: never into the training loop
                self.failed += 1
                log.error("checkpoint of step %d not written: %s: %s", job.step, type(e).__name__, e)
            self.last_persist_s = time.monotonic() - t0
            with self._cond:
                self._job = None
                skips, self._skips = self._skips, []
                self._cond.notify_all()
            for step, attempt, part in skips:
                try:  # best effort: without the marker the committer waits out its timeout
                    mark_skipped(self.storage, step, attempt, part)
                except Exception as e:
                    log.warning("could not mark part %d of step %d as skipped: %s", part, step, e)

    def _persist(self, job: _Job) -> None:
        buffers = self._snapshot.wait(self.config.snapshot_timeout_s)
        digest = int(job.digest.item()) if job.digest is not None else None
        if self.before_persist is not None:
            self.before_persist(job.step)
        t0 = time.monotonic()
        self._retrying(f"writing part {job.slot.part} of step {job.step}",
                       lambda: write_part(self.storage, job.step, job.attempt, job.slot.part, buffers, job.entries,
                                          job.skeleton, digest))
        if job.slot.part != 0:
            return
        wait_s = max(self.config.commit_timeout_s, 3 * (time.monotonic() - t0))
        done = self._retrying(f"committing step {job.step}",
                              lambda: commit(self.storage, job.step, job.attempt, job.slot, wait_s, self._stopped))
        if not done:
            self.failed += 1
            log.error("checkpoint of step %d not committed: a part was skipped or not written within %.0fs",
                      job.step, wait_s)
            return
        self.committed_step = job.step
        if self.on_commit is not None:
            try:
                self.on_commit(job.step, self.storage.url(layout.step_dir(job.step)))
            except Exception as e:
                log.warning("could not report checkpoint of step %d: %s", job.step, e)
        self._prune()

    def _retrying(self, what: str, fn: Callable[[], T]) -> T:
        """`fn` retried with this engine's backoff (storage.retry); while a retry waits,
        `trouble` says what failed, and once `fn` went through it is None again."""
        def failed(said: str) -> None:
            self._say(said)

        result = retry(what, fn, stopped=self._stopped, first_s=self.config.retry_first_s,
                       max_s=self.config.retry_max_s, on_failure=failed)
        self._say(None)
        return result

    def _prune(self) -> None:
        """Delete the checkpoints past `keep`, tried once: the next commit prunes what this one
        could not. Retried until it went through, it kept the engine busy after a commit
        while storage was away, and checkpoints due meanwhile were skipped."""
        try:
            done, incomplete = committed_steps(self.storage)
            for step in layout.to_delete(done, incomplete, self.config.keep):
                self.storage.remove(layout.step_dir(step))
        except Exception as e:
            self._say(f"pruning old checkpoints: {type(e).__name__}")
            log.warning("old checkpoints not pruned (the next commit tries again): %s: %s", type(e).__name__, e)
