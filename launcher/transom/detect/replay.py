"""`transom detect replay FILE`: the detectors over a recorded trace, offline.

The same `Detectors` the coordinator runs, fed the trace's rows in step order, with the
settings of spec.detection (`--detection JSON`). With `--json` the verdicts are one JSON
object, `{"verdicts": [{"replica", "rank", "kind", "first_step"}, ...]}`, so a trace from a
real run (`transom run --trace-out FILE`) can be judged again with other settings.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from transom.detect.detectors import Detectors, Verdict
from transom.detect.signals import DetectionSettings, read_trace


def replay(path: Path, settings: DetectionSettings) -> list[Verdict]:
    """Every verdict the detectors reach over the trace at `path` (ValueError: malformed)."""
    rows = sorted(read_trace(path), key=lambda s: (s.step, s.replica, s.rank))
    detectors = Detectors(settings)
    return detectors.observe_all(rows) + detectors.flush()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", type=Path, help="CSV trace (transom run --trace-out)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--detection", help="spec.detection as JSON (thresholds; default: the CRD's defaults)")


def main(args: argparse.Namespace) -> int:
    try:
        verdicts = replay(args.trace, DetectionSettings.from_spec(args.detection))
    except (OSError, ValueError) as e:
        print(f"transom detect replay: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({"verdicts": [v.summary() for v in verdicts]}))
    else:
        for v in verdicts:
            where = f"replica {v.replica}" + (f" rank {v.rank}" if v.rank is not None else "")
            print(f"step {v.first_step}: {v.kind} in {where}: {v.message}")
        if not verdicts:
            print("no anomalies")
    return 0
