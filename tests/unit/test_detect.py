"""The detectors over synthetic traces (pure logic), the trace format and `transom detect replay`."""

from __future__ import annotations

import dataclasses
import io
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from transom.detect.detectors import Detectors
from transom.detect.sdc import minority
from transom.detect.slow import _reference, _relative
from transom.detect.step_rows import DetectionSettings, Signal, read_trace, write_trace
from transom.detect.synthetic import Injection, TraceSpec, generate

REPO = Path(__file__).resolve().parents[2]


def verdicts(rows, settings=DetectionSettings()):
    d = Detectors(settings)
    return d.observe_all(rows) + d.flush()


def test_a_clean_trace_with_long_tailed_batches_raises_nothing():
    rows = list(generate(TraceSpec(steps=1500, seed=3)))
    seconds = [r.step_seconds for r in rows if (r.replica, r.rank) == (0, 0)]
    assert max(seconds) > 2.5 * min(seconds)  # the workload does vary a lot
    assert verdicts(rows) == []


@pytest.mark.parametrize("factor", [1.3, 2.0])
def test_a_slow_rank_is_named_within_twenty_steps(factor):
    rows = list(generate(TraceSpec(steps=400, seed=1, injections=[Injection("slow", 2, 3, 200, factor)])))
    found = verdicts(rows)
    assert [(v.replica, v.rank, v.kind) for v in found] == [(2, 3, "slow")]
    assert found[0].first_step == 200 and found[0].reached_step - 200 <= 20
    assert found[0].blame == "Node"


def test_a_rank_slow_from_its_first_step_is_named_against_the_other_ranks():
    # A replacement placed on a degraded device: its own history has no normal speed to
    # compare with, so the pool of every rank's normal steps is the measure.
    rows = list(generate(TraceSpec(steps=300, seed=1, injections=[Injection("slow", 2, 3, 0, 1.3)])))
    found = verdicts(rows)
    assert [(v.replica, v.rank, v.kind) for v in found] == [(2, 3, "slow")]
    settings = DetectionSettings()
    assert found[0].reached_step <= settings.warmup_steps + settings.slow_steps
    assert found[0].slowdown == pytest.approx(1.3, rel=0.05)


@given(st.lists(st.floats(0.1, 10.0), min_size=1, max_size=40))
def test_each_ranks_relative_ratio_is_over_the_median_of_the_replicas_medians(values):
    ratios = {(i // 4, i % 4): v for i, v in enumerate(values)}
    got = _relative(ratios, slow_factor=1.15)
    by_replica = {}
    for (replica, _), v in ratios.items():
        by_replica.setdefault(replica, []).append(v)
    medians = [statistics.median(v) for v in by_replica.values()]
    if len(medians) >= 3:
        ref = statistics.median(medians)
    elif all(m > 1.15 for m in medians):
        ref = min(medians)  # every replica slow at once: nobody's fault
    else:
        ref = 1.0  # too few replicas: each rank against its own history only
    for key, v in ratios.items():
        assert got[key] == pytest.approx(v / ref)


@given(st.lists(st.floats(0.5, 2.0), min_size=2, max_size=12), st.floats(0.0, 1e6))
def test_one_replica_cannot_move_the_reference_outside_the_others_range(honest, lie):
    ratios = {(r, 0): v for r, v in enumerate(honest)}
    ratios[(len(honest), 0)] = lie
    ref = _reference(ratios)
    if len(ratios) >= 3:
        assert min(honest) <= ref <= max(honest)
    else:
        assert ref is None


def _liar_trace(lie: float, steps: int = 300, replicas: int = 3, ranks: int = 1, seed: int = 5):
    """A clean trace in which replica `replicas - 1` reports every busy time times `lie`."""
    rows = generate(TraceSpec(replicas=replicas, ranks=ranks, steps=steps, seed=seed))
    return [dataclasses.replace(r, step_seconds=r.step_seconds * lie) if r.replica == replicas - 1 else r
            for r in rows]


@pytest.mark.parametrize("replicas", [2, 3, 5])
@pytest.mark.parametrize("lie", [1e-5, 0.5, 2.0, 1e4])
def test_one_replica_lying_about_its_busy_time_condemns_no_one_else(replicas, lie):
    found = verdicts(_liar_trace(lie, replicas=replicas))
    assert [v for v in found if v.replica != replicas - 1] == []


def test_a_liar_among_three_does_not_hide_a_slow_replica_from_the_own_history_check():
    # Two replicas and a liar: the honest slow one is still named (against its own history,
    # which the liar's figures do not enter), and the healthy one is not.
    rows = generate(TraceSpec(replicas=3, ranks=1, steps=300, seed=5, injections=[Injection("slow", 0, 0, 150, 1.5)]))
    rows = [dataclasses.replace(r, step_seconds=r.step_seconds * 1e-5) if r.replica == 2 else r for r in rows]
    found = [(v.replica, v.kind) for v in verdicts(rows)]
    assert (1, "slow") not in found and (0, "slow") in found


def test_a_liar_reporting_every_rank_of_others_cannot_vote_twice_on_fingerprints():
    # The SDC vote counts replicas, not rows: three replicas, one of them posts the wrong
    # fingerprint (its own): it alone is named, however many rows it sends.
    base = [Signal(step=50, replica=r, rank=0, step_seconds=0.1, fingerprint=7) for r in range(3)]
    liar = [Signal(step=50, replica=2, rank=0, step_seconds=0.1, fingerprint=9)] * 5
    found = verdicts(base[:2] + liar)
    assert [(v.replica, v.kind) for v in found] == [(2, "sdc")]


def test_a_new_incarnation_slow_from_its_start_is_named_too():
    # Replica 1 is replaced at step 150 (its history forgotten) and the new one is 1.5x slow.
    rows = list(generate(TraceSpec(steps=300, seed=2, injections=[Injection("slow", 1, 0, 150, 1.5)])))
    d = Detectors(DetectionSettings())
    found = []
    for row in rows:
        if row.step == 150 and (row.replica, row.rank) == (0, 0):
            d.forget(1)
        found += d.observe(row)
    assert [(v.replica, v.rank, v.kind) for v in found + d.flush()] == [(1, 0, "slow")]


def test_a_replica_whose_every_rank_is_slow_is_named_as_a_whole():
    inj = [Injection("slow", 1, k, 150, 1.5) for k in range(4)]
    found = verdicts(list(generate(TraceSpec(steps=300, seed=2, injections=inj))))
    assert [(v.replica, v.rank, v.kind) for v in found] == [(1, None, "slow")]


def test_a_slowdown_of_everyone_is_nobodys_fault():
    inj = [Injection("slow", r, k, 150, 1.5) for r in range(4) for k in range(4)]
    assert verdicts(list(generate(TraceSpec(steps=300, seed=2, injections=inj)))) == []


def test_hang_nan_and_bit_flip_are_each_named():
    inj = [Injection("hang", 2, 0, 100), Injection("nan", 3, 1, 150, steps=3), Injection("sdc", 0, 3, 207)]
    found = {(v.replica, v.kind): v for v in verdicts(list(generate(TraceSpec(steps=300, seed=4, injections=inj))))}
    assert set(found) == {(2, "hang"), (3, "nan"), (0, "sdc")}
    assert found[(3, "nan")].reached_step == 152  # the third non-finite step
    assert found[(0, "sdc")].reached_step == 250  # the next fingerprint after the flip
    assert found[(0, "sdc")].rank == 3 and found[(2, "hang")].blame == "Replica"


def test_one_non_finite_step_is_skipped_but_not_a_verdict_and_all_replicas_at_once_is_nobodys():
    assert verdicts(list(generate(TraceSpec(steps=200, injections=[Injection("nan", 1, 0, 100, steps=2)])))) == []
    everyone = [Injection("nan", r, 0, 100, steps=5) for r in range(4)]
    assert verdicts(list(generate(TraceSpec(steps=200, injections=everyone)))) == []


def test_a_loss_spike_on_one_replica_repeated_is_a_verdict():
    rows = list(generate(TraceSpec(steps=200, seed=5)))
    spiked = [Signal(**{**r.__dict__, "loss": r.loss * 20}) if r.replica == 2 and r.step in (120, 130, 140) else r
              for r in rows]
    assert [(v.replica, v.kind, v.first_step) for v in verdicts(spiked)] == [(2, "loss_spike", 120)]


def test_fingerprints_without_a_majority_blame_nobody():
    assert minority({0: 5, 1: 5, 2: 6}) == ([2], True)
    assert minority({0: 5, 1: 6}) == ([], True)
    assert minority({0: 5, 1: 5}) == ([], False)


def test_two_replicas_that_disagree_are_found_diverged_once_and_blamed_for_nothing():
    d = Detectors(DetectionSettings())
    rows = [Signal(step=49, replica=r, rank=0, step_seconds=0.1, fingerprint=5 + r) for r in range(2)]
    assert d.observe_all(rows) == []  # no verdict: nobody can be told to be wrong
    found = d.take_diverged()
    assert found == ("replicas 0, 1 hold different parameters or optimizer state at step 49 (rank 0) and no "
                     "majority says which is right")
    assert d.take_diverged() is None and d.diverged_at == 49
    # Agreeing replicas are not diverged.
    agreeing = Detectors(DetectionSettings())
    agreeing.observe_all([Signal(step=49, replica=r, rank=0, step_seconds=0.1, fingerprint=5) for r in range(2)])
    assert agreeing.take_diverged() is None


def test_a_rank_that_stops_reporting_holds_judgement_back_only_so_long():
    d = Detectors(DetectionSettings(), lag_steps=5)
    d.observe(Signal(step=0, replica=0, rank=0, step_seconds=1.0))
    d.observe(Signal(step=0, replica=1, rank=0, step_seconds=1.0))  # replica 1 goes silent after step 0
    found = []
    for step in range(1, 8):
        found += d.observe(Signal(step=step, replica=0, rank=0, step_seconds=1e6 if step == 1 else 1.0))
    # Step 1 waited for replica 1 until it was 5 steps old, then was judged without it.
    assert [(v.kind, v.first_step, v.reached_step) for v in found] == [("hang", 1, 1)]


def test_settings_from_the_spec_and_bad_ones_refused():
    s = DetectionSettings.from_spec('{"hangTimeoutSeconds": 5, "slowFactorPercent": 130, "action": "Report"}')
    assert (s.hang_timeout_s, s.slow_factor, s.action, s.bad_steps) == (5, 1.3, "Report", 3)
    assert DetectionSettings.from_spec(s.to_spec()) == s
    for bad, why in [('{"slowFactorPercent": 100}', "slowFactorPercent must be between 101 and 10000"),
                     ('{"nope": 1}', "unknown"), ('{"badSteps": true}', "type"),
                     ('{"slowAction": "Restart"}', "Replace, Report or Rebalance"), ("[1]", "object"),
                     ("{", "not JSON")]:
        with pytest.raises(ValueError, match=why):
            DetectionSettings.from_spec(bad)


def test_trace_round_trip_and_replay_cli(tmp_path):
    rows = list(generate(TraceSpec(steps=300, seed=6, injections=[Injection("slow", 0, 1, 150, 1.5),
                                                                   Injection("nan", 2, 0, 200, steps=4)])))
    path = tmp_path / "trace.csv"
    with open(path, "w", newline="") as f:
        write_trace(rows, f)
    header = path.read_text().splitlines()[0]
    assert header.startswith("step,replica,rank,step_seconds,tokens,sum_len_sq,loss,grad_norm")
    again = io.StringIO(newline="")
    write_trace(read_trace(path), again)
    assert again.getvalue().replace("8192.0,", "8192,") == open(path, newline="").read()  # nan != nan: compare text
    out = subprocess.run([sys.executable, "-m", "transom", "detect", "replay", str(path), "--json"],
                         capture_output=True, text=True, timeout=60, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert sorted((v["replica"], v["rank"], v["kind"], v["first_step"]) for v in got["verdicts"]) == \
        [(0, 1, "slow", 150), (2, None, "nan", 200)]


def test_replay_skips_a_malformed_row_and_names_its_line_but_refuses_a_file_that_is_no_trace(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("step,replica,rank,step_seconds,tokens,sum_len_sq,loss,grad_norm\n0,0,0,abc,,,,\n")
    out = subprocess.run([sys.executable, "-m", "transom", "detect", "replay", str(path), "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "skipped 1 malformed row(s)" in out.stderr and "bad.csv:2" in out.stderr
    assert json.loads(out.stdout)["skipped"] == 1
    with pytest.raises(ValueError, match="columns"):
        list(read_trace(_write(tmp_path / "x.csv", "a,b\n1,2\n")))


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_write_trace_writes_non_finite_losses_readably():
    buf = io.StringIO()
    write_trace([Signal(step=1, replica=0, rank=0, step_seconds=0.5, loss=float("nan"), finite=False)], buf)
    assert ",nan," in buf.getvalue()


def test_a_restarted_replica_is_not_waited_for_in_the_steps_it_missed():
    # Replica 1 dies after step 13 and its next incarnation reports from step 38 on: steps
    # 14..37 are judged as soon as it reports (before, they waited 64 steps, and with them the
    # fingerprints a joiner checks its snapshot against).
    d = Detectors(DetectionSettings())
    for step in range(14):
        d.observe_all([Signal(step=step, replica=r, rank=0, step_seconds=0.1) for r in range(3)])
    for step in range(14, 38):
        d.observe_all([Signal(step=step, replica=r, rank=0, step_seconds=0.1) for r in (0, 2)])
    assert d._judged == 13
    d.forget(1)  # its new incarnation posts
    d.observe_all([Signal(step=38, replica=r, rank=0, step_seconds=0.1, fingerprint=5 if r != 1 else None)
                   for r in range(3)])
    assert d._judged == 38 and d.fingerprint(38, 0).value == 5


def test_a_replica_aside_is_not_waited_for_in_the_steps_it_misses():
    # Replica 1 steps aside after 14 committed steps (an evaluation): steps 14.. are judged
    # from the others' rows at once, not 64 steps late; back at step 30 (catching up), it is
    # waited for again, and not for the steps it missed.
    d = Detectors(DetectionSettings())
    for step in range(14):
        d.observe_all([Signal(step=step, replica=r, rank=0, step_seconds=0.1) for r in range(3)])
    d.step_aside(1, 14)
    for step in range(14, 30):
        d.observe_all([Signal(step=step, replica=r, rank=0, step_seconds=0.1, fingerprint=7) for r in (0, 2)])
        assert d._judged == step and d.fingerprint(step, 0).value == 7
    d.observe_all([Signal(step=30, replica=r, rank=0, step_seconds=0.1) for r in (0, 2)])
    d.observe_all([Signal(step=30, replica=1, rank=0, step_seconds=0.1, recovery=True)])
    d.observe_all([Signal(step=31, replica=r, rank=0, step_seconds=0.1) for r in (0, 2)])
    assert d._judged == 30  # step 31 waits for replica 1's row again
    d.observe_all([Signal(step=31, replica=1, rank=0, step_seconds=0.1)])
    assert d._judged == 31
