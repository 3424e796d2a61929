"""One rank's step as the detectors see it, the trace format, and the detectors' settings.

`step_seconds` is the rank's own busy time in the step: the time it did not spend waiting for
other ranks or replicas (the cross-replica exchange, the commit vote, the quorum). In
synchronous training every rank's wall-clock step is the same, set by the slowest, so only
the busy time tells which rank is slow.

A trace is a CSV file with the columns of TRACE_COLUMNS, one row per rank and step (`transom
run --trace-out FILE`); `finite`, `fingerprint`, `recovery` and `batch_share` may follow. Empty cells
are unknown values; a non-finite loss is written `nan` or `inf`.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Literal, TextIO

# How often a launcher posts its pod's rows: once a second, or less often when many post.
# The coordinator takes about SIGNAL_POSTS_PER_S posts a second in all and tells every
# launcher in its answer how long to wait (`post_interval`): a 100,000-GPU job's 12,500
# launchers post every 12.5 s instead of sending 12,500 requests a second, while a small
# job keeps its once-a-second verdicts.
FORWARD_INTERVAL_S = 1.0
MAX_FORWARD_INTERVAL_S = 30.0
SIGNAL_POSTS_PER_S = 1000.0


def post_interval(posters: int) -> float:
    """Seconds between a launcher's posts when `posters` launchers post."""
    return min(max(FORWARD_INTERVAL_S, posters / SIGNAL_POSTS_PER_S), MAX_FORWARD_INTERVAL_S)


TRACE_COLUMNS = ("step", "replica", "rank", "step_seconds", "tokens", "sum_len_sq", "loss", "grad_norm")
OPTIONAL_COLUMNS = ("finite", "fingerprint", "recovery", "batch_share")
Action = Literal["Replace", "Report"]
SlowAction = Literal["Replace", "Report", "Rebalance"]
# spec.detection's field names (camelCase, as in the CRD) -> DetectionSettings' own
SPEC_NAMES = {"enabled": "enabled", "warmupSteps": "warmup_steps", "slowFactorPercent": "slow_factor",
              "slowSteps": "slow_steps", "lossSpikeZ": "loss_spike_z", "lossWindow": "loss_window",
              "badSteps": "bad_steps", "fingerprintInterval": "fingerprint_interval",
              "hangTimeoutSeconds": "hang_timeout_s", "action": "action", "slowAction": "slow_action"}


@dataclass(frozen=True)
class Signal:
    step: int  # the step this row describes (committed steps before it)
    replica: int
    rank: int
    step_seconds: float  # this rank's busy time (see the module's docstring)
    tokens: float | None = None  # the step's workload descriptor, as the script reports it
    sum_len_sq: float | None = None
    loss: float | None = None
    grad_norm: float | None = None
    finite: bool = True  # this rank's own loss and gradients (before averaging) were finite
    fingerprint: int | None = None  # of its parameters after the step's update (every K steps)
    recovery: bool = False  # the rank also served or fetched recovery state in this step: not judged slow
    batch_share: float | None = None  # its batch over its nominal one (Rebalance); None: nominal


@dataclass(frozen=True)
class DetectionSettings:
    """What the detectors flag and what a verdict does (the CRD's spec.detection)."""

    enabled: bool = True
    warmup_steps: int = 20
    """Steps each rank is observed before it can be called slow (its predictor is fitted on them)."""
    slow_factor: float = 1.15
    """A step is slow when the rank's busy time exceeds the prediction for its workload by this
    factor, relative to the other ranks of the same step."""
    slow_steps: int = 10
    """Slow steps in a row before a `slow` verdict."""
    loss_spike_z: float = 10.0
    """A loss this many robust standard deviations (1.4826 MAD) above the median of the
    replica's recent losses, and at least twice that median, is a spike."""
    loss_window: int = 100
    """Recent losses the median is taken over; also the window repeated bad steps count in."""
    bad_steps: int = 3
    """Non-finite or spiking steps of one replica within `loss_window` steps before a verdict."""
    fingerprint_interval: int = 50
    """Every this many steps each rank fingerprints its parameters (0: never)."""
    hang_timeout_s: float = 300.0
    """No step progress for this long makes the launcher dump every worker's stacks and restart."""
    action: Action = "Replace"
    """What a verdict does: Replace (the replica is taken out and replaced) or Report."""
    slow_action: SlowAction = "Report"
    """What a `slow` verdict does: Report (the default: an event and a metric; replicas that
    share CPUs with other work are slow without a faulty device), Replace, or Rebalance (the
    slow replica gets a smaller share of each global batch and the others more, until it is
    at normal speed again: transom/detect/rebalance.py)."""

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.slow_steps < 1 or self.bad_steps < 1 or self.loss_window < 2:
            raise ValueError("warmup_steps >= 0, slow_steps >= 1, bad_steps >= 1 and loss_window >= 2 are required")
        if not (math.isfinite(self.slow_factor) and self.slow_factor > 1):
            raise ValueError(f"slow_factor must be a number above 1, got {self.slow_factor}")
        if not (math.isfinite(self.loss_spike_z) and self.loss_spike_z > 0):
            raise ValueError(f"loss_spike_z must be positive, got {self.loss_spike_z}")
        if self.fingerprint_interval < 0:
            raise ValueError("fingerprint_interval must not be negative")
        if not (math.isfinite(self.hang_timeout_s) and self.hang_timeout_s > 0):
            raise ValueError(f"hang_timeout_s must be a positive number of seconds, got {self.hang_timeout_s}")
        if self.action not in ("Replace", "Report"):
            raise ValueError(f"action must be Replace or Report, got {self.action}")
        if self.slow_action not in ("Replace", "Report", "Rebalance"):
            raise ValueError(f"slow_action must be Replace, Report or Rebalance, got {self.slow_action}")

    def action_for(self, kind: str) -> str:
        return self.slow_action if kind == "slow" else self.action

    @classmethod
    def from_spec(cls, text: str | None) -> "DetectionSettings":
        """From spec.detection as JSON (TRANSOM_DETECTION, `--detection`); missing fields keep
        their defaults. ValueError names an unknown field or a bad value."""
        if not text:
            return cls()
        try:
            spec = json.loads(text)
        except ValueError as e:
            raise ValueError(f"detection settings are not JSON: {e}") from None
        if not isinstance(spec, dict):
            raise ValueError("detection settings must be a JSON object like spec.detection")
        unknown = set(spec) - set(SPEC_NAMES)
        if unknown:
            raise ValueError(f"unknown detection settings {sorted(unknown)}; known: {sorted(SPEC_NAMES)}")
        kinds = {f.name: f.type for f in fields(cls)}
        values = {}
        for key, value in spec.items():
            name = SPEC_NAMES[key]
            want = {"bool": bool, "int": int, "float": (int, float)}.get(str(kinds[name]), str)
            if isinstance(value, bool) != (want is bool) or not isinstance(value, want):
                raise ValueError(f"detection setting {key} has the wrong type: {value!r}")
            values[name] = value / 100 if key == "slowFactorPercent" else value  # the API has no floats
        return replace(cls(), **values)

    def to_spec(self) -> str:
        spec = {key: getattr(self, name) for key, name in SPEC_NAMES.items()}
        spec["slowFactorPercent"] = round(self.slow_factor * 100)
        return json.dumps(spec)


# --- traces ---------------------------------------------------------------------------------------
def _cell(value: object) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "1" if value else "0"
    return repr(value) if isinstance(value, float) else str(value)


def write_trace(rows: Iterable[Signal], out: TextIO, header: bool = True) -> None:
    w = csv.writer(out)
    if header:
        w.writerow([*TRACE_COLUMNS, *OPTIONAL_COLUMNS])
    for s in rows:
        d = asdict(s)
        w.writerow([_cell(d[c]) for c in (*TRACE_COLUMNS, *OPTIONAL_COLUMNS)])


def read_trace(path: Path) -> Iterator[Signal]:
    """The signals of a trace file; ValueError (with the line) for a malformed row."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = set(TRACE_COLUMNS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: not a trace: columns {sorted(missing)} are missing")
        for line, row in enumerate(reader, start=2):
            try:
                yield _row(row)
            except (ValueError, KeyError) as e:
                raise ValueError(f"{path}:{line}: {e}") from None


def _row(row: dict[str, str]) -> Signal:
    def num(name: str) -> float | None:
        raw = (row.get(name) or "").strip()
        return float(raw) if raw else None

    def whole(name: str) -> int:
        raw = (row.get(name) or "").strip()
        if not raw.lstrip("-").isdigit():
            raise ValueError(f"{name} must be an integer, got {raw!r}")
        return int(raw)

    seconds = num("step_seconds")
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"step_seconds must be a non-negative number, got {row.get('step_seconds')!r}")
    loss = num("loss")
    finite_cell = (row.get("finite") or "").strip()
    finite = finite_cell != "0" if finite_cell else (loss is None or math.isfinite(loss))
    fingerprint = (row.get("fingerprint") or "").strip()
    recovery = (row.get("recovery") or "").strip() == "1"
    share = num("batch_share")
    if share is not None and not (math.isfinite(share) and share > 0):
        raise ValueError(f"batch_share must be a positive number, got {row.get('batch_share')!r}")
    return Signal(step=whole("step"), replica=whole("replica"), rank=whole("rank"), step_seconds=seconds,
                  tokens=num("tokens"), sum_len_sq=num("sum_len_sq"), loss=loss, grad_norm=num("grad_norm"),
                  finite=finite, fingerprint=int(fingerprint) if fingerprint else None, recovery=recovery,
                  batch_share=share)
