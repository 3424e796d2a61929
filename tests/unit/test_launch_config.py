"""The settings of `transom launch` and `transom run` (launch/config.py) are the one source of
the CLI's defaults."""

from __future__ import annotations

import argparse

import pytest

from transom import cli
from transom.launch.config import LaunchConfig, RunConfig, default_of


def _cli_defaults(command: str) -> dict:
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {a.dest: a.default for a in sub.choices[command]._actions}


@pytest.mark.parametrize("flag, field_name", [
    ("nproc_per_replica", "nproc_per_replica"), ("min_replicas", "min_replicas"), ("spares", "spares"),
    ("collective_timeout", "collective_timeout_s"), ("heartbeat_timeout", "heartbeat_timeout_s"),
    ("max_restarts", "max_restarts"), ("timeout", "timeout_s"), ("backend", "backend"),
])
def test_run_flags_default_to_run_config(flag, field_name):
    assert _cli_defaults("run")[flag] == default_of(RunConfig, field_name)


def test_launch_flags_default_to_launch_config():
    assert _cli_defaults("launch")["max_restarts"] == default_of(LaunchConfig, "max_restarts")
    assert default_of(RunConfig, "max_restarts") == default_of(LaunchConfig, "max_restarts")


def test_default_of_refuses_a_field_without_a_value():
    with pytest.raises(AssertionError):
        default_of(RunConfig, "command")
