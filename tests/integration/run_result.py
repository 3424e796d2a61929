"""What a job under test left behind, whether its replicas were processes (`transom run`,
conftest.py) or threads (threaded_job.py): its summary, its output, and the per-step
records and final digests its workers wrote, so tests assert on what happened."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class RunResult:
    returncode: int
    summary: dict
    output: str
    stats_dir: Path
    results: dict[int, Any] = field(default_factory=dict)  # a threaded job's: what each replica's body returned

    def records(self, replica: int) -> list[dict]:
        """All step records of a replica, over its incarnations, in time order."""
        out = []
        for path in sorted(self.stats_dir.glob(f"steps-r{replica}-g*-a*.jsonl")):
            for line in path.read_text().splitlines():
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    pass  # the last line of a SIGKILLed worker may be cut short
        return sorted(out, key=lambda r: r["t"])

    def digests(self) -> dict[tuple[int, int], str]:
        """(replica, rank) -> sha256 of the rank's final parameters."""
        out = {}
        for path in self.stats_dir.glob("final-r*-k*.json"):
            f = json.loads(path.read_text())
            out[(f["replica"], f["rank"])] = f["digest"]
        return out

    def incarnations(self, replica: int) -> int:
        return len(list(self.stats_dir.glob(f"steps-r{replica}-g*-a*.jsonl")))

    def end_step(self) -> int:
        """The step the job ended at after its `--end-on` events (the event the test is about);
        AssertionError naming the events it still waited for when the step cap came first."""
        end_on = self.summary.get("end_on")
        assert end_on is not None, "the run had no --end-on"
        assert end_on["met"], (f"the job reached its step cap before {', '.join(end_on['waiting_for'])} happened; "
                               f"output:\n{self.output[-3000:]}")
        assert self.summary["completed_step"] == end_on["end_step"], (self.summary, self.output[-3000:])
        return end_on["end_step"]

    def assert_finished_together(self, replicas: int) -> None:
        """The run succeeded, every replica completed the job at one step with the same
        weights, and, with `--end-on`, it ended on its events (not at its step cap)."""
        s = self.summary
        assert self.returncode == 0, self.output[-3000:]
        if "end_on" in s:
            self.end_step()
        assert s["replicas_finished"] == replicas, self.output[-3000:]
        assert s["replicas_bit_identical"] is True, self.output[-3000:]
