"""The end-of-run summary of `transom run`, computed from the workers' statistics files.

Pure functions over the files written by `transom.ft.stats` (no torch needed), so the
figures can be checked in unit tests on hand-made records.

`healthy_stall_seconds` is the wall time the replicas that never failed lost because of
the failures of others: for each such replica, the excess over its normal step time of
every step that was disrupted (run under a changed quorum, discarded, or run again after a
discarded one), not counting its first step (start-up); the figure is the largest over
those replicas. `final_loss` is the mean training loss of the last 10 committed steps,
averaged over replicas. A figure that is not finite (the loss of a run that diverged) is
written null: NaN and Infinity are not JSON (`finite_json`).

`steps_committed` is the newest step any replica committed, from the step records (not from
the final digests, which a run stopped before the end has none of). `replicas_bit_identical`
says only what was compared: the replicas that finished holding the job's state
(`replicas_compared`); a replica left out (`replicas_not_compared`: one still catching up
when the job ended, one that failed or was stopped) is named with why, and with fewer than
two compared the figure is null, not false.
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeGuard

from transom import worker_files
from transom.detect.step_rows import Signal, TraceParser, write_trace

FINAL_LOSS_STEPS = 10
MAX_STATS_BYTES = 64 << 20  # of one worker's step records or signal rows (some 200,000 steps); more is cut
MAX_FINAL_BYTES = 1 << 16  # of one final digest file
_STEPS = re.compile(r"steps-r(\d+)-g(\d+)-a(\d+)\.jsonl$")
_FINAL = re.compile(r"final-r(\d+)-k(\d+)\.json$")


@dataclass
class Incarnation:
    replica: int
    generation: int
    attempt: int
    records: list[dict] = field(default_factory=list)


def load(directory: Path) -> tuple[dict[int, list[Incarnation]], list[dict]]:
    """The step records and final digests in `directory`. The workers' scripts write there:
    a path that is no regular file is skipped (worker_files.py), so is a line or a file
    that is not a record."""
    by_replica: dict[int, list[Incarnation]] = {}
    finals: list[dict] = []
    for path in sorted(directory.iterdir()):
        if m := _STEPS.match(path.name):
            if (data := worker_files.read(path, MAX_STATS_BYTES)) is None:
                continue
            replica, generation, attempt = (int(g) for g in m.groups())
            inc = Incarnation(replica, generation, attempt)
            inc.records = [r for r in map(_parsed, data.splitlines()) if _is_record(r)]
            by_replica.setdefault(inc.replica, []).append(inc)
        elif _FINAL.match(path.name):
            final = _parsed(worker_files.read(path, MAX_FINAL_BYTES) or b"")
            if _is_final(final):
                finals.append(final)
    for incs in by_replica.values():
        incs.sort(key=lambda i: (i.generation, i.attempt))
    return by_replica, finals


def _parsed(line: bytes) -> object:
    try:
        return json.loads(line)
    except ValueError:  # a line cut short by SIGKILL, bytes that are not UTF-8
        return None


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_record(r: object) -> TypeGuard[dict]:
    """A step record is an object; the figures below check the fields they read (a worker's
    script can write any JSON there)."""
    return isinstance(r, dict)


def _is_final(f: object) -> TypeGuard[dict]:
    return (isinstance(f, dict) and all(isinstance(f.get(k), int) for k in ("replica", "rank", "step"))
            and isinstance(f.get("digest"), str))


def stall_seconds(records: list[dict]) -> float:
    """Excess time of disrupted steps over the median undisrupted step, first step excluded."""
    records = [r for r in records if _number(r.get("seconds"))]  # ft/stats.py's always have it
    normal: list[float] = []
    disrupted: list[float] = []
    previous_failed = False
    for i, r in enumerate(records):
        if i == 0:
            previous_failed = not r.get("committed", False)
            continue
        hit = r.get("quorum_changed") or not r.get("committed") or previous_failed
        (disrupted if hit else normal).append(float(r["seconds"]))
        previous_failed = not r.get("committed", False)
    if not disrupted:
        return 0.0
    base = statistics.median(normal) if normal else 0.0
    return sum(max(0.0, s - base) for s in disrupted)


def committed_steps(by_replica: dict[int, list[Incarnation]], finals: list[dict]) -> int:
    """The job's committed steps: the newest step any replica committed (a committed record's
    `step` is the count after it) or finished at; 0 if none. Read from the step records, so
    a run stopped before the end (SIGTERM, a timeout) still says how far it got."""
    steps = [int(r["step"]) for incs in by_replica.values() for inc in incs for r in inc.records
             if r.get("committed") and isinstance(r.get("step"), int)]
    steps += [int(f["step"]) for f in finals]
    return max(steps, default=0)


@dataclass(frozen=True)
class Comparison:
    """Whether the replicas that held the job's state at the end ended bit-identical.

    A replica is compared if it finished the job holding its state (it wrote its final
    digests: ft/commit.py writes none for one still catching up, nor for one that failed or
    was stopped). `identical`: True if the compared replicas ended at one step with the same
    parameter bytes, rank by rank; False if they did not; None if fewer than two were
    compared, so nothing was (`not_compared` says why of each replica left out)."""

    identical: bool | None
    compared: list[int]
    not_compared: list[dict]  # {"replica": id, "why": one line}


def compare_replicas(by_replica: dict[int, list[Incarnation]], finals: list[dict], num_replicas: int) -> Comparison:
    finished = sorted({int(f["replica"]) for f in finals})
    not_compared = [{"replica": r, "why": why_not_finished(by_replica.get(r, []))}
                    for r in range(num_replicas) if r not in finished]
    if len(finished) < 2:
        return Comparison(None, finished, not_compared)
    digests_by_rank: dict[int, set[str]] = {}
    for f in finals:
        digests_by_rank.setdefault(f["rank"], set()).add(f["digest"])
    same = len({f["step"] for f in finals}) == 1 and all(len(d) == 1 for d in digests_by_rank.values())
    return Comparison(same, finished, not_compared)


def why_not_finished(incarnations: list[Incarnation]) -> str:
    """Why a replica wrote no final digests, from its step records, in one line."""
    if not incarnations:
        return "it never started"
    last = incarnations[-1].records
    if not last:
        again = "its restarted incarnation" if len(incarnations) > 1 else "it"
        return f"{again} had trained no step when the run ended"
    if last[-1].get("recovering"):
        return "it was still catching up from its peers when the run ended: its weights were not yet the job's"
    return f"it had not finished the job when the run ended (its last step record: step {last[-1].get('step')})"


def summarize(directory: Path, num_replicas: int, faults_per_replica: dict[int, int], wall_seconds: float) -> dict:
    """The summary dict; faults_per_replica counts the faults injected into each replica.

    `replicas_bit_identical` compares the replicas that finished holding the job's state
    (`Comparison`): null, never false, where fewer than two did, so that a replica still
    catching up, or a run stopped before the end, is not taken for replicas that differ.
    """
    by_replica, finals = load(directory)
    restarts = sum(len(incs) - 1 for incs in by_replica.values())
    # A fault meant for the k-th incarnation fired if a (k+1)-th incarnation exists.
    fired = sum(min(n, len(by_replica.get(r, [])) - 1) for r, n in faults_per_replica.items() if r in by_replica)
    healthy = [incs[0] for incs in by_replica.values() if len(incs) == 1]
    stall = max((stall_seconds(inc.records) for inc in healthy), default=0.0)
    final_losses = []
    for incs in by_replica.values():
        losses = [r["loss"] for inc in incs for r in inc.records if r.get("committed") and _number(r.get("loss"))]
        if losses:  # the last few steps, so one batch's noise does not decide
            tail = losses[-FINAL_LOSS_STEPS:]
            final_losses.append(sum(tail) / len(tail))
    comparison = compare_replicas(by_replica, finals, num_replicas)
    return {
        "steps_committed": committed_steps(by_replica, finals),
        "replica_restarts": restarts,
        "failures_injected": fired,
        "healthy_stall_seconds": round(stall, 3),
        "replicas_bit_identical": comparison.identical,
        "replicas_compared": comparison.compared,
        "replicas_not_compared": comparison.not_compared,
        "final_loss": round(sum(final_losses) / len(final_losses), 6) if final_losses else None,
        "wall_seconds": round(wall_seconds, 3),
        "replicas_finished": len(comparison.compared),
    }


def finite_json(value: object, indent: int | None = None) -> str:
    """`value` as JSON, every non-finite float in it as null."""
    return json.dumps(_finite(value), indent=indent, allow_nan=False)


def _finite(value: object) -> object:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


@dataclass(frozen=True)
class ReplicaRow:
    """A replica's line in the closing table of `transom run`."""

    replica: int
    incarnations: int  # processes started for it: in-place restarts and new generations
    recoveries: int  # steps it took a peer's state in
    committed: int  # committed steps its rank 0 recorded, over all incarnations
    final_step: int | None  # where it completed, None if it did not
    log: str | None = None


def replica_rows(directory: Path, num_replicas: int, logs: dict[int, str] | None = None) -> list[ReplicaRow]:
    by_replica, finals = load(directory)
    final_step = {f["replica"]: f["step"] for f in finals if f.get("rank", 0) == 0}
    rows = []
    for r in range(num_replicas):
        records = [rec for inc in by_replica.get(r, []) for rec in inc.records]
        rows.append(ReplicaRow(
            replica=r, incarnations=len(by_replica.get(r, [])),
            recoveries=sum(1 for rec in records if rec.get("recovering")),
            committed=sum(1 for rec in records if rec.get("committed")),
            final_step=final_step.get(r), log=(logs or {}).get(r),
        ))
    return rows


def merge_trace(directory: Path, out: Path) -> int:
    """Every worker's signal rows (all incarnations) as one CSV trace in step order."""
    rows: list[Signal] = []
    for path in sorted(directory.glob("signals-*.csv")):
        data = worker_files.read(path, MAX_STATS_BYTES)  # never open() a worker's file: a FIFO blocks
        if data is None:
            continue
        parser = TraceParser()
        try:
            rows.extend(parser.feed(data))
            rows.extend(parser.end())
        except ValueError as e:  # a worker killed mid-row: keep what it wrote before
            logging.getLogger("transom.launch").info("trace: %s: %s", path, e)
    rows.sort(key=lambda r: (r.step, r.replica, r.rank))
    with open(out, "w", newline="") as f:
        write_trace(rows, f)
    return len(rows)
