"""benchmarks/_rounds.py and the recovery benchmark's per-round ratios: a figure is the median
of the rounds' ratios with its spread, and two runs agree when either median lies within the
other's p25-p75."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import recovery  # noqa: E402
from _rounds import agreement, agrees, flat, last_json, spread, step_times  # noqa: E402


def test_the_spread_is_the_median_and_the_quartiles():
    s = spread([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s == {"median": 3.0, "p25": 2.0, "p75": 4.0, "n": 5}
    assert spread([0.7]) == {"median": 0.7, "p25": 0.7, "p75": 0.7, "n": 1}
    assert spread([]) == {"n": 0}
    assert flat("ratio", s) == {"ratio": 3.0, "ratio_p25": 2.0, "ratio_p75": 4.0, "ratio_rounds": 5}


def test_two_runs_agree_when_a_median_lies_within_the_other_spread():
    first = {"r": 1.00, "r_p25": 0.98, "r_p75": 1.03}
    assert agrees(first, {"r": 1.02, "r_p25": 1.01, "r_p75": 1.05}, "r") is True
    assert agrees(first, {"r": 1.20, "r_p25": 1.15, "r_p75": 1.25}, "r") is False
    assert agrees(first, {"other": 1.0}, "r") is None
    both = agreement({"cpu_bound": first}, {"cpu_bound": {"r": 1.5, "r_p25": 1.4, "r_p75": 1.6}}, ["r", "q"],
                     ["cpu_bound", "accelerator_shaped"])
    assert both == {"cpu_bound": {"r": False}, "accelerator_shaped": {}}


def test_the_previous_output_is_read_from_its_last_json_line(tmp_path):
    out = tmp_path / "run.txt"
    out.write_text('round 0 ...\n{"a": 1}\nmedian ...\n{"a": 2}\n')
    assert last_json(str(out)) == {"a": 2}
    out.write_text("no json here\n")
    with pytest.raises(SystemExit, match="no JSON line"):
        last_json(str(out))


def test_step_times_are_the_gaps_between_step_ends_after_the_warmup(tmp_path):
    (tmp_path / "ddp-r0-1.jsonl").write_text('{"start": 0}\n' + "".join(f'{{"t": {t}}}\n' for t in (1, 2, 4, 7)))
    assert step_times(tmp_path, "ddp", warmup=1) == [2, 3]


def _run(step_s: float, at_kill: float, at_rejoin: float, ok: bool = True) -> dict:
    return {"ok": ok, "step_s": step_s, "healthy_stall_at_kill_s": at_kill, "healthy_stall_at_rejoin_s": at_rejoin}


def test_recovery_pairs_the_runs_of_one_round_and_skips_failed_ones():
    runs = {"transom": [_run(1.0, 0.1, 0.05), _run(1.1, 0.1, 0.0), _run(1.0, 0.2, 0.2, ok=False)],
            "torchft": [_run(0.5, 0.5, 0.5), _run(1.0, 0.0, 0.0), _run(1.0, 1.0, 1.0)]}
    ratios = recovery.round_ratios(runs)
    assert ratios["ratio_step_vs_torchft"] == [2.0, 1.1]
    assert ratios["ratio_total_healthy_stall_vs_torchft"] == [pytest.approx(0.15)]  # torchft stalled 0 in round 1
    assert ratios["rejoin_stall_fraction_of_step"] == [0.05, 0.0]
    summary = recovery.summarise({k: v for k, v in runs.items()}, [1.0, 2.0], {"BENCH_SHAPE": "cpu_bound"})
    assert summary["ratio_step_vs_torchft"] == 1.55 and summary["ratio_step_vs_torchft_rounds"] == 2
    assert summary["targets_met"] == {"ratio_step_vs_torchft": False, "ratio_total_healthy_stall_vs_torchft": True,
                                      "rejoin_stall_fraction_of_step": True}


def _records(ts, seconds, contributing_from=0.0):
    return [{"step": i + 1, "t": t, "seconds": s, "committed": True, "contributing": t >= contributing_from}
            for i, (t, s) in enumerate(zip(ts, seconds))]


def test_recovery_takes_the_failure_free_step_from_both_sides_of_the_fault():
    """The load drifts: 1.0 s steps before the kill, 0.8 s after the rejoin; the window in
    between runs at 0.9 s. Against both sides (0.9 s) the stall at rejoin is 0, where a
    baseline from before the kill alone would call it negative."""
    ts = [float(t) for t in range(1, 61)]
    healthy = [1.0] * 20 + [0.9] * 22 + [0.8] * 18
    killed = {"start": 0.0, "records": _records(ts[:20], healthy[:20])}
    rejoined = {"start": 22.0, "records": _records(ts[25:], healthy[25:], contributing_from=35.0)}
    runs = {0: [{"start": 0.0, "records": _records(ts, healthy)}], 1: [killed, rejoined],
            2: [{"start": 0.0, "records": _records(ts, healthy)}]}
    figures = recovery.analyse(runs, kill_step=20)
    assert figures["step_before_kill_s"] == 1.0 and figures["step_after_rejoin_s"] == 0.8
    assert figures["step_s"] == 0.9
    assert abs(figures["healthy_stall_at_rejoin_s"]) < 1e-9
    assert figures["rejoin_time_s"] == 4.0 and figures["contributing_after_s"] == 13.0
