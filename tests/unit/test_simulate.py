"""The goodput simulator (transom/simulate): accounting, calibration against the published
figures, and the command."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from transom.simulate.engine import simulate
from transom.simulate.model import PRESETS, Costs, Scenario, Strategy, ft_hsdp, sync, transom

HUNDRED_K = PRESETS["ft-hsdp-100k"]


def test_the_ft_hsdp_preset_reproduces_the_published_sync_and_ft_hsdp_figures():
    assert HUNDRED_K.mtbf_minutes == pytest.approx(18.0)
    assert simulate(HUNDRED_K, sync()).effective == pytest.approx(0.44, abs=0.03)
    assert simulate(HUNDRED_K, ft_hsdp()).effective == pytest.approx(0.80, abs=0.03)
    assert simulate(HUNDRED_K, transom()).effective >= 0.90


def test_the_llama3_preset_gives_its_strategy_over_ninety_percent():
    sc = PRESETS["llama3-16k"]
    assert 466 / 54 == pytest.approx(24 * 60 / sc.mtbf_minutes, rel=1e-6)  # interruptions per day
    assert simulate(sc, sc.strategies[0]).effective > 0.90


def test_no_failures_costs_only_the_checkpoints():
    sc = dataclasses.replace(HUNDRED_K, failures_per_gpu_hour=1e-12, days=1.0)
    r = simulate(sc, sync())
    assert r.failures == 0
    assert r.effective == pytest.approx(1 - 5.0 / 605.0, abs=1e-3)  # a 5 s stall per 10 min of training
    assert set(r.lost_gpu_hours) == {"checkpoint_save"}


def test_a_replica_level_failure_costs_the_others_nothing_but_the_missing_share():
    lone = Strategy("x", "x", Costs(replica=(("restart", 600.0),)), Costs(replica=(("restart", 600.0),)),
                    rollback=False, checkpoint_interval_s=0, checkpoint_stall_s=0)
    sc = Scenario("t", gpus=80, replicas=10, failures_per_gpu_hour=1 / 80, hardware_share=0.5, strategies=(lone,),
                  days=20.0)
    r = simulate(sc, lone, seed=3)
    # One failure an hour, each taking one replica in ten away for 10 minutes: ~1/60 lost.
    assert 1 - r.effective == pytest.approx(1 / 60, rel=0.15)
    assert set(r.lost_gpu_hours) == {"restart"}


def test_seeds_repeat_and_differ():
    a, b, c = (simulate(HUNDRED_K, sync(), seed=s) for s in (1, 1, 2))
    assert a == b and a.effective != c.effective


def test_command_prints_one_json_line_last_and_refuses_nonsense(tmp_path):
    out = subprocess.run([sys.executable, "-m", "transom", "simulate", "--preset", "ft-hsdp-100k", "--days", "5",
                          "--json"], capture_output=True, text=True, timeout=120, check=True)
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert {"sync_goodput", "ft_hsdp_goodput", "transom_goodput", "transom_lost"} <= set(last)
    bad = subprocess.run([sys.executable, "-m", "transom", "simulate", "--preset", "ft-hsdp-100k", "--gpus", "10"],
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "at least one replica" in bad.stderr


def test_plot_is_a_png(tmp_path):
    png = tmp_path / "goodput.png"
    subprocess.run([sys.executable, "-m", "transom", "simulate", "--preset", "llama3-16k", "--days", "2",
                    "--plot", str(png)], capture_output=True, text=True, timeout=300, check=True)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _simulate(*flags: str, timeout: float = 20) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transom", "simulate", "--preset", "ft-hsdp-100k", *flags],
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("flags, message", [
    (["--gpus", "99999999999999999999999"], "--gpus: must be at most 10000000"),  # ran for ever
    (["--gpus", "10000000", "--days", "3650"], "at most 1,000,000 are simulated"),
    (["--days", "nan"], "--days: must be above 0"),
    (["--days", "inf"], "--days: must be above 0"),
    (["--seed", "-1"], "--seed: must be at least 0"),
])
def test_inputs_that_would_run_for_ever_are_refused_at_once(flags, message):
    out = _simulate(*flags)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("where, message", [("/nonexistent/x.png", "no directory /nonexistent"),
                                            (".", "is a directory")])
def test_an_unwritable_plot_is_refused_before_the_simulation_runs(where, message):
    # It used to simulate every strategy, then fail with a traceback.
    out = _simulate("--plot", where)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr
    assert out.stdout == ""  # nothing simulated
