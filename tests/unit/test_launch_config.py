"""The settings of `transom launch` and `transom run` (launch/config.py) are the one source of
the CLI's defaults."""

from __future__ import annotations

import argparse

import pytest
from pydantic_core import PydanticUndefined

from transom import cli, flags
from transom.launch.config import LaunchConfig, RunConfig, default_of


def _options(command: str) -> dict[str, argparse.Action]:
    sub = next(a for a in cli.parser()._actions if isinstance(a, argparse._SubParsersAction))
    return {o: a for a in sub.choices[command]._actions for o in a.option_strings}


def test_run_flags_not_given_leave_the_models_defaults():
    args = cli.parser().parse_args(["run", "--replicas", "2"])
    config = flags.build(RunConfig, args, cli.RUN_FLAGS, command=["true"])
    for name in cli.RUN_FLAGS:
        if name not in ("replicas", "job_name"):  # given; made by the run when not given
            assert getattr(config, name) == default_of(RunConfig, name), name


@pytest.mark.parametrize("command, model, names", [
    ("run", RunConfig, cli.RUN_FLAGS), ("launch", LaunchConfig, cli.LAUNCH_FLAGS)])
def test_each_flag_is_its_settings_field_with_its_help_and_default(command, model, names):
    options = _options(command)
    for name in names:
        action, info = options[flags.flag_of(name)], model.model_fields[name]
        assert action.dest == name and action.help and info.description and action.help.startswith(info.description)
        if info.default not in (None, "", PydanticUndefined) and info.annotation is not bool:
            assert action.help.endswith(f"(default: {info.default})")


def test_a_flag_given_is_checked_by_the_model_and_named_in_the_refusal():
    args = cli.parser().parse_args(["run", "--replicas", "2", "--heartbeat-timeout", "0", "--end-margin", "x"])
    with pytest.raises(ValueError) as e:
        flags.build(RunConfig, args, cli.RUN_FLAGS, command=["true"])
    assert str(e.value) == ("--heartbeat-timeout must be a positive, finite number of seconds, got '0'; "
                            "--end-margin is not an integer, got 'x'")


def test_launch_and_run_restart_the_workers_as_often_by_default():
    assert default_of(RunConfig, "max_restarts") == default_of(LaunchConfig, "max_restarts")


def test_default_of_refuses_a_field_without_a_value():
    with pytest.raises(AssertionError):
        default_of(RunConfig, "command")
