"""Non-blocking catch-up in real multi-process runs: a replica rejoins and nobody waits for it.

`transom run` with the tiny GPT example; faults are real SIGKILLs. The sources' bandwidth
for the catch-up is capped (TRANSOM_RECOVERY_BYTES_PER_S), so the transfer of the ~5 MB
snapshot outlasts several training steps: the joiner records the updates it sees while it
fetches and replays them, and every replica ends bit-identical. The kills land where
recovery is fragile: a source while it serves chunks, a joiner while it catches up, three
failures in a row. Each job ends a few steps after the last killed replica caught up
(`--end-on`); its step count is only a cap.
"""

from __future__ import annotations

import pytest

from test_fault_tolerance import CAP

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
SNAPSHOT_BYTES_PER_S = "2000000"  # the tiny GPT's ~5 MB snapshot: about 2.5 s at this cap


def catching_up(records: list[dict]) -> list[dict]:
    """The committed steps a replica spent catching up (contributing zeros)."""
    return [r for r in records if r["committed"] and r["recovering"]]


def condemned(output: str) -> list[str]:
    """The sources a joiner dropped as wrong. A snapshot that only its own source could vouch
    for is set aside while another source is left (snapshot_check.decide): that drop says
    nothing against the source, and which step was lone depends on timing."""
    return [line for line in output.splitlines()
            if "catch-up: dropping source" in line and "nobody but its source confirms" not in line]


def test_a_throttled_catch_up_outlasts_several_steps_and_the_others_do_not_wait(transom_run, monkeypatch):
    monkeypatch.setenv("TRANSOM_RECOVERY_BYTES_PER_S", SNAPSHOT_BYTES_PER_S)
    # Ten steps after the catch-up, all three training, are the reference below.
    result = transom_run(["--replicas", "3", "--inject", "kill:replica=1,step=10,phase=forward",
                          "--end-on", "caught_up:1", "--end-margin", "14"], CAP)
    result.assert_finished_together(3)
    joined = catching_up(result.records(1))
    # The others did not wait for the transfer: they committed several steps while it ran
    # (a wait would have held them at the joiner's first step). How much a catch-up slows
    # their step is a speed figure, not an event: benchmarks/recovery.py measures it.
    assert len(joined) >= 4, f"the transfer should outlast several steps, took {len(joined)}"
    window = {r["step"] for r in joined}
    for healthy in (0, 2):
        committed = {r["step"] for r in result.records(healthy) if r["committed"]}
        assert window <= committed, f"replica {healthy} missed steps {sorted(window - committed)} during the catch-up"
    assert "replica 1 caught up at step" in result.output  # the coordinator's event
    # Honest sources' manifests fit the joiner's fresh model and optimizer (its Adam state
    # made at the first step): none is dropped by the joiner's checks (ft/sources.py).
    assert not condemned(result.output)


def test_a_source_killed_mid_transfer_the_joiner_resumes_from_the_other(transom_run, monkeypatch):
    monkeypatch.setenv("TRANSOM_RECOVERY_BYTES_PER_S", SNAPSHOT_BYTES_PER_S)
    # 20 chunks of 256 KiB: both sources are asked for some, whichever published first.
    monkeypatch.setenv("TRANSOM_RECOVERY_CHUNK_BYTES", str(256 << 10))
    result = transom_run(["--replicas", "3", "--inject", "kill:replica=2,step=10",
                          "--inject", "kill:replica=0,step=1,phase=serve",
                          "--end-on", "caught_up:0", "--end-on", "caught_up:2"], CAP)
    result.assert_finished_together(3)
    assert result.summary["failures_injected"] == 2
    assert result.incarnations(0) == 2 and result.incarnations(2) == 2
    assert "dropped" in result.output  # the joiner lost a source mid-transfer and went on
    assert not condemned(result.output)  # a dead source is not a liar
    for replica in (0, 2):
        assert catching_up(result.records(replica)), f"replica {replica} never caught up"


def test_three_failures_in_a_row_two_of_them_while_joining(transom_run, monkeypatch):
    monkeypatch.setenv("TRANSOM_RECOVERY_BYTES_PER_S", SNAPSHOT_BYTES_PER_S)
    faults = ["kill:replica=1,step=10", "kill:replica=1,step=2,phase=catchup", "kill:replica=1,step=1,phase=catchup"]
    # Replica 1 catches up only in its fourth incarnation: the other two die while catching up.
    result = transom_run(["--replicas", "3", *[a for f in faults for a in ("--inject", f)], "--end-on", "caught_up:1"],
                         CAP)
    result.assert_finished_together(3)
    assert result.summary["failures_injected"] == 3
    assert result.incarnations(1) == 4
    for healthy in (0, 2):
        assert result.incarnations(healthy) == 1, (result.summary["events"], result.output[-3000:])
