"""Settings the code cannot live with are refused at the door, at once, with a message.

The `transom` command line (argparse types and the run's own checks), the coordinator's
Settings, and the worker-side configs: nan, infinities, zero or negative timeouts, ranks
that do not exist, a script that is not there, contradictory heartbeat settings. Each case
must fail before anything starts (no coordinator, no process), as exit code 2.
"""

from __future__ import annotations

import math
import time

import pytest

from transom import cli, contract
from transom.coordinator.membership import Settings

RUN = ["run", "--replicas", "2", "--quiet"]
SCRIPT = ["--", "python", __file__]


@pytest.mark.parametrize("argv, message", [
    (RUN + ["--heartbeat-timeout", "nan"] + SCRIPT, "finite number of seconds"),
    (RUN + ["--collective-timeout", "nan"] + SCRIPT, "finite number of seconds"),
    (RUN + ["--collective-timeout", "inf"] + SCRIPT, "finite number of seconds"),
    (RUN + ["--timeout", "-1"] + SCRIPT, "positive, finite number of seconds"),
    (RUN + ["--heartbeat-timeout", "0"] + SCRIPT, "positive, finite number of seconds"),
    (RUN + ["--nproc-per-replica", "0"] + SCRIPT, "must be at least 1"),
    (RUN + ["--max-restarts", "-1"] + SCRIPT, "must be at least 0"),
    (RUN + ["--checkpoint-keep", "0"] + SCRIPT, "must be at least 1"),
    (["coordinator", "--replicas", "2", "--heartbeat-timeout", "0"], "positive, finite number of seconds"),
    (["coordinator", "--replicas", "2", "--round-timeout", "nan"], "finite number of seconds"),
    (["coordinator", "--replicas", "0"], "must be at least 1"),
    (RUN + ["--backend", "mpi"] + SCRIPT, "invalid choice: 'mpi'"),
    (["launch", "--nproc-per-node", "0", "--", "python", __file__], "must be at least 1"),
])
def test_bad_flags_are_refused_by_the_parser(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == contract.EXIT_USAGE
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (RUN + ["--inject", "kill:replica=0,step=3,rank=2"] + SCRIPT, "names rank 2, but a replica has only 1"),
    (RUN + ["--inject", "kill:replica=5,step=3"] + SCRIPT, "names replica 5, but there are only 2"),
    (RUN + ["--min-replicas", "3"] + SCRIPT, "--min-replicas must be between 1 and --replicas"),
    (RUN + ["--", "python", "/no/such/train.py"], "no such script: /no/such/train.py"),
    (RUN + ["--", "python", "-u", "/no/such/train.py"], "no such script: /no/such/train.py"),
    (RUN + ["--", "no-such-program-7f3a"], "command not found"),
    (RUN, "a command to run is required"),
    (RUN + ["--backend", "nccl"] + SCRIPT, "--backend nccl needs a GPU per worker"),
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
