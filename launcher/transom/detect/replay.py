"""`transom detect replay FILE`: the detectors over a recorded trace, offline.

The same `Detectors` the coordinator runs, fed the trace's rows in step order, with the
settings of spec.detection (`--detection JSON`). With `--json` the verdicts are one JSON
object, `{"verdicts": [{"replica", "rank", "kind", "first_step"}, ...], "skipped": N}`, so a
trace from a real run (`transom run --trace-out FILE`) can be judged again with other
settings. A row that is not one (transom/detect/step_rows.py `TraceParser`) is skipped: the
count, and the first such line, go to stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from transom.detect.detectors import Detectors, Verdict
from transom.detect.step_rows import DetectionSettings, TraceParser, read_trace


@dataclass(frozen=True)
class Replay:
    verdicts: list[Verdict]
    skipped: int  # malformed rows, not judged
    first_skipped: tuple[int, str] | None  # (line, why)


def replay(path: Path, settings: DetectionSettings) -> Replay:
    """Every verdict the detectors reach over the trace at `path` (ValueError: not a trace)."""
    parser = TraceParser()
    rows = sorted(read_trace(path, parser), key=lambda s: (s.step, s.replica, s.rank))
    detectors = Detectors(settings)
    return Replay(detectors.observe_all(rows) + detectors.flush(), parser.skipped, parser.first_skipped)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="CSV trace (transom run --trace-out)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--detection", help="spec.detection as JSON (thresholds; default: the CRD's defaults)")


def main(args: argparse.Namespace) -> int:
    try:
        result = replay(args.trace, DetectionSettings.from_spec(args.detection))
    except (OSError, ValueError) as e:
        print(f"transom detect replay: {e}", file=sys.stderr)
        return 2
    if result.first_skipped is not None:
        line, why = result.first_skipped
        print(f"transom detect replay: skipped {result.skipped} malformed row(s); the first: {args.trace}:{line}: "
              f"{why}", file=sys.stderr)
    if args.json:
        print(json.dumps({"verdicts": [v.summary() for v in result.verdicts], "skipped": result.skipped}))
    else:
        for v in result.verdicts:
            where = f"replica {v.replica}" + (f" rank {v.rank}" if v.rank is not None else "")
            print(f"step {v.first_step}: {v.kind} in {where}: {v.message}")
        if not result.verdicts:
            print("no anomalies")
    return 0
