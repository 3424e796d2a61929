"""One rank's step as the detectors see it, the trace format, and the detectors' settings.

`step_seconds` is the rank's own busy time in the step: the time it did not spend waiting for
other ranks or replicas (the cross-replica exchange, the commit vote, the quorum). In
synchronous training every rank's wall-clock step is the same, set by the slowest, so only
the busy time tells which rank is slow.

A trace is a CSV file with the columns of TRACE_COLUMNS, one row per rank and step (`transom
run --trace-out FILE`); `finite`, `fingerprint`, `recovery`, `batch_share` and `input_digest` may
follow. Empty cells are unknown values; a non-finite loss is written `nan` or `inf`.

`input_digest` is a 64-bit digest of the input the rank trained on in that step (ft/input_digest.py),
on the steps `input_digest_due` names only: the coordinator compares the digests of one step
across ranks and replicas (detect/duplicates.py), and replicas that train on the same batches
are told so.

A trace comes from a worker's script, and so does every worker's signals file the launcher
reads: `TraceParser` takes any bytes. A line that is not a row (bad UTF-8, longer than
MAX_LINE_BYTES, the wrong number of cells, a count that is negative, a workload that is not
a finite number) is skipped and counted, and the rest is read on.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, TextIO, cast

from transom.defaults import FORWARD_INTERVAL_S, MAX_FORWARD_INTERVAL_S  # noqa: F401  (re-exported)
from transom.words import DetectAction, VerdictKind

# How often a launcher posts its pod's rows: once a second, or less often when many post.
# The coordinator takes about SIGNAL_POSTS_PER_S posts a second in all and tells every
# launcher in its answer how long to wait (`post_interval`): a 100,000-GPU job's 12,500
# launchers post every 12.5 s instead of sending 12,500 requests a second, while a small
# job keeps its once-a-second verdicts.
SIGNAL_POSTS_PER_S = 1000.0


def post_interval(posters: int) -> float:
    """Seconds between a launcher's posts when `posters` launchers post."""
    return min(max(FORWARD_INTERVAL_S, posters / SIGNAL_POSTS_PER_S), MAX_FORWARD_INTERVAL_S)


# Which steps' inputs every rank digests: the first few (a sampler seeded by the rank alone
# repeats from step 0 on, so it is told at once) and then every INPUT_DIGEST_INTERVAL-th (one
# that goes wrong later: a restart, an epoch boundary). Workers and coordinator share the
# schedule: the coordinator takes digests of these steps only, so that no replica can fill
# its memory of digests with steps of its own choosing.
INPUT_DIGEST_FIRST_STEPS = 3
INPUT_DIGEST_INTERVAL = 50


def input_digest_due(step: int) -> bool:
    """Whether ranks digest the input they train on in `step` (counted from the job's start)."""
    return step < INPUT_DIGEST_FIRST_STEPS or step % INPUT_DIGEST_INTERVAL == 0


TRACE_COLUMNS = ("step", "replica", "rank", "step_seconds", "tokens", "sum_len_sq", "loss", "grad_norm")
OPTIONAL_COLUMNS = ("finite", "fingerprint", "recovery", "batch_share", "input_digest")
Action = Literal[DetectAction.REPLACE, DetectAction.REPORT]
SlowAction = DetectAction
# spec.detection's field names (camelCase, as in the CRD) -> DetectionSettings' own
SPEC_NAMES = {"enabled": "enabled", "warmupSteps": "warmup_steps", "slowFactorPercent": "slow_factor",
              "slowSteps": "slow_steps", "lossSpikeZ": "loss_spike_z", "lossWindow": "loss_window",
              "badSteps": "bad_steps", "fingerprintInterval": "fingerprint_interval",
              "hangTimeoutSeconds": "hang_timeout_s", "action": "action", "slowAction": "slow_action"}
# The range of each numeric setting, in spec.detection's units: DetectionSettings refuses what
# the CRD refuses (operator/transom_operator/api.py builds the CRD's spec.detection from these).
SPEC_BOUNDS: dict[str, tuple[int, int]] = {
    "warmupSteps": (0, 100_000), "slowFactorPercent": (101, 10_000), "slowSteps": (1, 100_000),
    "lossSpikeZ": (1, 1_000_000), "lossWindow": (2, 100_000), "badSteps": (1, 100_000),
    "fingerprintInterval": (0, 1_000_000), "hangTimeoutSeconds": (1, 86_400)}


def _own_units(key: str, value: float) -> float:
    """A spec.detection value in DetectionSettings' units (the API has no floats: a percentage)."""
    return value / 100 if key == "slowFactorPercent" else value


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
    input_digest: int | None = None  # of the input it trained on (the steps input_digest_due names)


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
    action: Action = DetectAction.REPLACE
    """What a verdict does: Replace (the replica is taken out and replaced) or Report."""
    slow_action: SlowAction = DetectAction.REPORT
    """What a `slow` verdict does: Report (the default: an event and a metric; replicas that
    share CPUs with other work are slow without a faulty device), Replace, or Rebalance (the
    slow replica gets a smaller share of each global batch and the others more, until it is
    at normal speed again: transom/detect/rebalance.py)."""

    def __post_init__(self) -> None:
        for key, (low, high) in SPEC_BOUNDS.items():
            name, value = SPEC_NAMES[key], getattr(self, SPEC_NAMES[key])
            if not _own_units(key, low) <= value <= _own_units(key, high):  # nan is in no range
                raise ValueError(f"{name} must be between {_own_units(key, low):.15g} and "
                                 f"{_own_units(key, high):.15g}, got {value!r}")
        if self.action not in (DetectAction.REPLACE, DetectAction.REPORT):
            raise ValueError(f"action must be Replace or Report, got {self.action}")
        if self.slow_action not in tuple(DetectAction):
            raise ValueError(f"slow_action must be Replace, Report or Rebalance, got {self.slow_action}")
        object.__setattr__(self, "action", DetectAction(self.action))  # the enum, also when given a string
        object.__setattr__(self, "slow_action", DetectAction(self.slow_action))

    def action_for(self, kind: str) -> DetectAction:
        return self.slow_action if kind == VerdictKind.SLOW else self.action

    @classmethod
    def from_spec(cls, text: str | None) -> DetectionSettings:
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
        values: dict[str, Any] = {}
        for key, value in spec.items():
            name = SPEC_NAMES[key]
            types: dict[str, type | tuple[type, ...]] = {"bool": bool, "int": int, "float": (int, float)}
            want = types.get(str(kinds[name]), str)
            if isinstance(value, bool) != (want is bool) or not isinstance(value, want):
                raise ValueError(f"detection setting {key} has the wrong type: {value!r}")
            value = cast(Any, value)  # of the type its field wants (checked just above)
            if key in SPEC_BOUNDS and not SPEC_BOUNDS[key][0] <= value <= SPEC_BOUNDS[key][1]:
                low, high = SPEC_BOUNDS[key]  # named as the user wrote it, in its units
                raise ValueError(f"detection setting {key} must be between {low} and {high}, got {value!r}")
            values[name] = _own_units(key, value)
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
    for s in rows:  # getattr, not asdict: a worker writes a row every step, and asdict deep-copies
        w.writerow([_cell(getattr(s, c)) for c in (*TRACE_COLUMNS, *OPTIONAL_COLUMNS)])


# --- reading: any bytes ------------------------------------------------------------------------------
MAX_LINE_BYTES = 64 * 1024  # a row is ~150 bytes: a longer line is no row (and csv refuses cells over 128 KiB)
MAX_INDEX = 2**62 - 1  # steps, replicas and ranks: below the coordinator's bound on steps, so the step after
# the last one a rank reported is one too (the hang watchdog reports that one)
_BINARY = ("", "0", "1")
_INTEGER = re.compile(r"-?[0-9]{1,19}")  # up to int64's digits: int() of a longer cell is work for nothing


class TraceParser:
    """The rows in a trace's bytes, fed as they come; a line that is no row is skipped and counted.

    `columns` None: the first line is the header and names the columns (a `--trace-out` file);
    otherwise every row has these columns and a header line (it starts with `step`) is passed
    over (a worker's signals file, read while it grows)."""

    def __init__(self, columns: Sequence[str] | None = None):
        self.columns = tuple(columns) if columns is not None else None
        self.skipped = 0
        self.first_skipped: tuple[int, str] | None = None  # (line, why) of the first line skipped
        self._line = 0
        self._partial = b""
        self._overlong = False  # the line under way passed MAX_LINE_BYTES: skipped when it ends

    def feed(self, data: bytes) -> list[Signal]:
        """The rows of the lines `data` completes; an unfinished last line waits for the rest.
        ValueError only for a first line that is not a trace's header (`columns` None)."""
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        rows = []
        for line in lines:
            if self._overlong:  # the end of a line whose start was already dropped
                self._overlong = False
                self._line += 1
                self.skip(f"longer than {MAX_LINE_BYTES} bytes")
            elif (row := self._take(line)) is not None:
                rows.append(row)
        if len(self._partial) > MAX_LINE_BYTES:  # not kept: a writer without newlines must not fill memory
            self._partial, self._overlong = b"", True
        return rows

    def end(self) -> list[Signal]:
        """The row of a last line without a newline (the file is complete)."""
        return self.feed(b"\n") if self._partial or self._overlong else []

    def skip(self, why: str) -> None:
        """Count a line as skipped (also one its reader refuses for reasons of its own)."""
        self.skipped += 1
        if self.first_skipped is None:
            self.first_skipped = (self._line, why)

    def _take(self, line: bytes) -> Signal | None:
        self._line += 1
        line = line.rstrip(b"\r")  # csv writes \r\n
        if not line.strip():
            return None
        try:
            if len(line) > MAX_LINE_BYTES:
                raise ValueError(f"longer than {MAX_LINE_BYTES} bytes")
            cells = next(csv.reader([line.decode()]))  # UnicodeDecodeError is a ValueError
        except (ValueError, csv.Error) as e:
            if self.columns is None:
                raise ValueError(f"not a trace: its first line is no header ({e})") from None
            self.skip(str(e))
            return None
        if self.columns is None:
            missing = set(TRACE_COLUMNS) - set(cells)
            if missing:
                raise ValueError(f"not a trace: columns {sorted(missing)} are missing")
            self.columns = tuple(cells)
            return None
        if cells[:1] == ["step"]:
            return None  # a header
        try:
            if len(cells) != len(self.columns):
                raise ValueError(f"{len(cells)} cells, not {len(self.columns)}")
            return _row(dict(zip(self.columns, cells)))
        except ValueError as e:
            self.skip(str(e))
            return None


def read_trace(path: Path, parser: TraceParser | None = None) -> Iterator[Signal]:
    """The signals of a trace file; malformed rows are skipped and counted in `parser`.
    ValueError: the file is no trace (its header lacks a column)."""
    parser = parser if parser is not None else TraceParser()
    with open(path, "rb") as f:
        try:
            while chunk := f.read(1 << 20):
                yield from parser.feed(chunk)
            yield from parser.end()
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None


def _row(cell: dict[str, str]) -> Signal:
    """A row's cells as a Signal; ValueError names the first bad cell."""
    seconds = _number(cell, "step_seconds")
    if seconds is None or not (math.isfinite(seconds) and seconds >= 0):
        raise ValueError(f"step_seconds must be a non-negative number, got {_shown(cell, 'step_seconds')}")
    tokens, sum_len_sq = _number(cell, "tokens"), _number(cell, "sum_len_sq")
    for name, value in (("tokens", tokens), ("sum_len_sq", sum_len_sq)):
        if value is not None and not (math.isfinite(value) and value >= 0):  # a workload, not a verdict
            raise ValueError(f"{name} must be a non-negative number, got {_shown(cell, name)}")
    share = _number(cell, "batch_share")
    if share is not None and not (math.isfinite(share) and share > 0):
        raise ValueError(f"batch_share must be a positive number, got {_shown(cell, 'batch_share')}")
    for name in ("finite", "recovery"):
        if _text(cell, name) not in _BINARY:
            raise ValueError(f"{name} must be 0, 1 or empty, got {_shown(cell, name)}")
    loss = _number(cell, "loss")  # nan and inf are what the detectors look for
    finite = _text(cell, "finite") != "0" if _text(cell, "finite") else (loss is None or math.isfinite(loss))
    return Signal(step=_index(cell, "step"), replica=_index(cell, "replica"), rank=_index(cell, "rank"),
                  step_seconds=seconds, tokens=tokens, sum_len_sq=sum_len_sq, loss=loss,
                  grad_norm=_number(cell, "grad_norm"), finite=finite, fingerprint=_int64(cell, "fingerprint"),
                  recovery=_text(cell, "recovery") == "1", batch_share=share,
                  input_digest=_int64(cell, "input_digest"))


def _text(cell: dict[str, str], name: str) -> str:
    return (cell.get(name) or "").strip()


def _shown(cell: dict[str, str], name: str) -> str:
    return repr(_text(cell, name)[:40])  # a cell can be 64 KiB long: the log gets its start


def _number(cell: dict[str, str], name: str) -> float | None:
    raw = _text(cell, name)
    try:
        return float(raw) if raw else None
    except ValueError:
        raise ValueError(f"{name} must be a number, got {_shown(cell, name)}") from None


def _int64(cell: dict[str, str], name: str) -> int | None:
    raw = _text(cell, name)
    if raw and not (_INTEGER.fullmatch(raw) and -(2**63) <= int(raw) < 2**63):
        raise ValueError(f"{name} must be a 64-bit integer, got {_shown(cell, name)}")
    return int(raw) if raw else None


def _index(cell: dict[str, str], name: str) -> int:
    raw = _text(cell, name)
    if not (_INTEGER.fullmatch(raw) and 0 <= int(raw) <= MAX_INDEX):
        raise ValueError(f"{name} must be an integer from 0 to 2^62 - 1, got {_shown(cell, name)}")
    return int(raw)
