"""`transom run --log-dir` (what `make demo` runs): the terminal shows progress, events and
the closing table only; the workers' own output, a SIGKILLed worker's included, lands in
one file per replica, named in the summary."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_log_dir_keeps_the_terminal_to_progress_and_the_logs_per_replica(transom_run, tmp_path):
    logs = tmp_path / "logs"
    result = transom_run(["--replicas", "2", "--inject", "kill:replica=1,step=10", "--log-dir", str(logs),
                          "--end-on", "caught_up:1"], ["--steps", "500", "--log-every", "10"])
    result.assert_finished_together(2)
    terminal = result.output.splitlines()
    # The worker's own lines (the example prints its loss; the launcher logs the kill) are not here...
    assert not any("transom.launch" in line or "transom.ft" in line for line in terminal), result.output[-3000:]
    assert any("FAIL  replica 1" in line for line in terminal)
    assert any(line.split()[:2] == ["replica", "incarnations"] for line in terminal)
    # ...but in the replica's file, every incarnation appended.
    assert sorted(p.name for p in logs.iterdir()) == ["coordinator.log", "replica-0.log", "replica-1.log"]
    killed = (logs / "replica-1.log").read_text()
    assert "killed by SIGKILL" in killed
    assert result.summary["logs"] == {str(r): str(logs / f"replica-{r}.log") for r in range(2)}
    row = next(line.split() for line in terminal if line.split()[:1] == ["1"] and line.endswith("replica-1.log"))
    assert int(row[1]) >= 2, row  # two incarnations of replica 1
