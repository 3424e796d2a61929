"""Settings the code cannot live with are refused at the door, at once, with a message.

The `transom` command line (argparse types and the run's own checks), the coordinator's
Settings, and the worker-side configs: nan, infinities, zero or negative timeouts, ranks
that do not exist, a script that is not there, contradictory heartbeat settings. Each case
must fail before anything starts (no coordinator, no process), as exit code 2.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time

import pytest

from transom import cli, contract
from transom.coordinator.membership import Settings
from transom.detect.step_rows import SPEC_BOUNDS, SPEC_NAMES, DetectionSettings

RUN = ["run", "--replicas", "2", "--quiet"]
SCRIPT = ["--", "python", __file__]


def refusal(argv: list[str], capsys) -> str:
    """What `transom ARGV` says on stderr as it exits with EXIT_USAGE: from argparse (a
    SystemExit) or from a settings model (the command returns it), before anything starts."""
    code: object
    try:
        code = cli.main(argv)
    except SystemExit as e:
        code = e.code
    assert code == contract.EXIT_USAGE
    return capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (RUN + ["--heartbeat-timeout", "nan"] + SCRIPT, "--heartbeat-timeout must be a finite number of seconds"),
    (RUN + ["--collective-timeout", "nan"] + SCRIPT, "finite number of seconds"),
    (RUN + ["--collective-timeout", "inf"] + SCRIPT, "finite number of seconds"),
    (RUN + ["--timeout", "-1"] + SCRIPT, "--timeout must be a positive, finite number of seconds, got '-1'"),
    (RUN + ["--heartbeat-timeout", "0"] + SCRIPT, "positive, finite number of seconds"),
    (RUN + ["--nproc-per-replica", "0"] + SCRIPT, "--nproc-per-replica must be at least 1"),
    (RUN + ["--max-restarts", "-1"] + SCRIPT, "must be at least 0"),
    (RUN + ["--checkpoint-keep", "0"] + SCRIPT, "must be at least 1"),
    (RUN + ["--end-margin", "-1"] + SCRIPT, "--end-margin must be at least 0"),
    (RUN + ["--spares", "x"] + SCRIPT, "--spares is not an integer, got 'x'"),
    (["coordinator", "--replicas", "2", "--heartbeat-timeout", "0"], "positive, finite number of seconds"),
    (["coordinator", "--replicas", "2", "--round-timeout", "nan"], "finite number of seconds"),
    (["coordinator", "--replicas", "0"], "must be at least 1"),
    (RUN + ["--backend", "mpi"] + SCRIPT, "--backend must be one of auto, gloo, nccl, got 'mpi'"),
    (["launch", "--nproc-per-node", "0", "--", "python", __file__], "--nproc-per-node must be at least 1"),
    # Bounded above too: a huge value is a typo that would overflow a wait or a loop later.
    (RUN + ["--timeout", "1e300"] + SCRIPT, "must be at most 2,592,000 seconds"),
    (RUN + ["--heartbeat-timeout", "86400"] + SCRIPT, "must be at most 3,600 seconds"),
    (RUN + ["--max-restarts", "100000000000000000000"] + SCRIPT, "must be at most 10,000"),
    (RUN + ["--checkpoint-keep", "1001"] + SCRIPT, "must be at most 1,000"),
    (RUN + ["--checkpoint-interval", "99999999999"] + SCRIPT, "must be at most 10,000,000"),
    (RUN + ["--replicas", "9" * 5000] + SCRIPT, "is not an integer"),
    (["coordinator", "--replicas", "5000"], "--replicas must be at most 4,096"),
    (["coordinator", "--replicas", "2", "--port", "70000"], "must be at most 65535"),
    (["coordinator", "--replicas", "2", "--startup-wait", "inf"], "--startup-wait must be a finite number of seconds"),
])
def test_bad_flags_are_refused_at_once(argv, message, capsys):
    assert message in refusal(argv, capsys)


@pytest.mark.parametrize("argv, message", [
    (RUN + ["--inject", "kill:replica=0,step=3,rank=2"] + SCRIPT, "names rank 2, but a replica has only 1"),
    (RUN + ["--inject", "kill:replica=5,step=3"] + SCRIPT, "names replica 5, but there are only 2"),
    (RUN + ["--min-replicas", "3"] + SCRIPT, "--min-replicas must be between 1 and --replicas"),
    (RUN + ["--", "python", "/no/such/train.py"], "no such script: /no/such/train.py"),
    (RUN + ["--", "python", "-u", "/no/such/train.py"], "no such script: /no/such/train.py"),
    (RUN + ["--", "no-such-program-7f3a"], "command not found"),
    (RUN, "a command to run is required"),
    (RUN + ["--backend", "nccl"] + SCRIPT, "--backend nccl needs a GPU per worker"),
    (RUN + ["--detection", '{"lossWindow": 100000000000000000000}'] + SCRIPT,
     "lossWindow must be between 2 and 100000"),
    (RUN + ["--detection", '{"lossSpikeZ": NaN}'] + SCRIPT, "lossSpikeZ must be between 1 and 1000000"),
])
def test_runs_that_could_only_fail_later_are_refused_now(argv, message, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU, also on a GPU machine
    t0 = time.monotonic()
    assert cli.main(argv) == contract.EXIT_USAGE
    assert message in capsys.readouterr().err
    assert time.monotonic() - t0 < 5  # before any retry or restart


@pytest.mark.parametrize("flags, message", [
    (["--heartbeat-interval", "5", "--heartbeat-timeout", "3"], "larger than heartbeat_interval_s"),
    (["--round-timeout", "1", "--failed-grace", "1"], "round_timeout_s must be larger than failed_grace_s"),
    (["--min-replicas", "3"], "min_replicas must be between 1 and num_replicas"),
    (["--detection", '{"hangTimeoutSeconds": 100000000000000000000}'],
     "hangTimeoutSeconds must be between 1 and 86400"),
])
def test_contradicting_coordinator_settings_end_in_a_message_not_a_traceback(flags, message, capsys, monkeypatch):
    monkeypatch.setenv(contract.ENV_COORDINATOR_TOKEN, "t")
    assert cli.main(["coordinator", "--replicas", "2", *flags]) == contract.EXIT_USAGE
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("timeout", [1, 2, 3, 30])
def test_any_heartbeat_timeout_the_crd_allows_makes_a_coordinator(timeout):
    # The operator passes only --heartbeat-timeout; the interval follows it.
    args = cli.parser().parse_args(["coordinator", "--replicas", "2", "--heartbeat-timeout", str(timeout)])
    settings = cli.coordinator_settings(args)
    assert settings.heartbeat_interval_s == min(1.0, timeout / 3) < settings.heartbeat_timeout_s


@pytest.mark.parametrize("field", ["heartbeat_interval_s", "heartbeat_timeout_s", "failed_grace_s",
                                   "round_timeout_s", "startup_wait_s"])
def test_settings_refuse_nan_and_infinity(field):
    for value in (math.nan, math.inf):
        with pytest.raises(ValueError, match="finite"):
            Settings(num_replicas=2, **{field: value})


def test_worker_configs_refuse_nan_timeouts():
    from transom.checkpoint.engine import CheckpointConfig
    from transom.ft import FTConfig

    for field in ("collective_timeout_s", "quorum_timeout_s", "recovery_timeout_s"):
        with pytest.raises(ValueError, match="finite"):
            FTConfig(**{field: math.nan})
    with pytest.raises(ValueError, match="finite"):
        CheckpointConfig(uri="/tmp/x", commit_timeout_s=math.nan)


def test_a_detection_setting_out_of_range_ends_transom_run_at_once_in_one_line(tmp_path):
    """It used to start every worker, each of which died of an OverflowError (a deque of 1e20),
    and the launchers restarted them until they gave up."""
    script = tmp_path / "train.py"
    script.write_text("raise SystemExit('the workers must not start')\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "transom", "run", "--replicas", "2", "--quiet",
                          "--detection", '{"lossWindow": 100000000000000000000}', "--", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == contract.EXIT_USAGE
    assert time.monotonic() - t0 < 10
    assert out.stderr.strip().splitlines() == [
        "transom run: detection setting lossWindow must be between 2 and 100000, got 100000000000000000000"]


@pytest.mark.parametrize("key", sorted(SPEC_BOUNDS))
def test_detection_settings_refuse_what_the_crd_refuses_naming_the_setting(key):
    low, high = SPEC_BOUNDS[key]
    for value in (low - 1, high + 1, 10**20):
        with pytest.raises(ValueError, match=f"detection setting {key} must be between {low} and {high}"):
            DetectionSettings.from_spec(json.dumps({key: value}))
    for value in (math.nan, math.inf):  # JSON's NaN and Infinity: not a number of steps either
        with pytest.raises(ValueError, match=f"detection setting {key} (must be between|has the wrong type)"):
            DetectionSettings.from_spec(json.dumps({key: value}))
    name = SPEC_NAMES[key]
    with pytest.raises(ValueError, match=f"{name} must be between"):
        DetectionSettings(**{name: high * 1000})
    for value in (low, high):  # the ends are in
        DetectionSettings.from_spec(json.dumps({key: value}))


def test_the_crd_and_the_detectors_bound_each_detection_setting_alike():
    from transom_operator import api

    for key, (low, high) in SPEC_BOUNDS.items():
        field = next(f for f in api.Detection.model_fields.values() if f.alias == key)
        bounds = [(getattr(m, "ge", None), getattr(m, "le", None)) for m in field.metadata]
        ge = next(b for b, _ in bounds if b is not None)
        le = next(b for _, b in bounds if b is not None)
        assert (ge, le) == (low, high), key


def test_a_pods_launcher_refuses_detection_settings_out_of_range_before_starting_workers(capsys, monkeypatch):
    # In a pod the settings come from the environment (the operator writes spec.detection there).
    for name, value in {contract.ENV_COORDINATOR_URL: "http://127.0.0.1:9", contract.ENV_REPLICA_ID: "0",
                        contract.ENV_NUM_REPLICAS: "1", contract.ENV_COORDINATOR_TOKEN: "t",
                        contract.ENV_DETECTION: '{"lossWindow": 100000000000000000000}'}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv(contract.ENV_OWNER_PID, raising=False)
    monkeypatch.delenv(contract.ENV_SPARE_ID, raising=False)
    t0 = time.monotonic()
    assert cli.main(["launch", "--", sys.executable, __file__]) == contract.EXIT_USAGE
    assert capsys.readouterr().err.strip() == (
        "transom launch: detection setting lossWindow must be between 2 and 100000, got 100000000000000000000")
    assert time.monotonic() - t0 < 5
