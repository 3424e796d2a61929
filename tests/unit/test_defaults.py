"""One place for defaults (transom/defaults.py): every timeout that the CLI, FTConfig, the
coordinator's Settings, `transom run` and the CRD default to comes from it, and the docs'
table is generated from it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from transom import cli, defaults
from transom.coordinator.membership import Settings
from transom.defaults import CLUSTER, LOCAL
from transom.launch.config import RunConfig
from transom_operator import api

ROOT = Path(__file__).resolve().parents[2]


def test_the_docs_table_is_generated_from_the_module():
    assert (ROOT / "docs" / "defaults.md").read_text() == defaults.table(), "run `make generate`"


def _cli_defaults(command: str) -> dict:
    sub: Any = next(a for a in cli.parser()._actions if a.dest == "cmd" or getattr(a, "choices", None))
    return {a.dest: a.default for a in sub.choices[command]._actions}


@pytest.mark.parametrize("command, dest, value", [
    ("coordinator", "status_interval", LOCAL.status_interval_s),
])
def test_the_cli_defaults_are_the_local_ones(command, dest, value):
    assert _cli_defaults(command)[dest] == value


def test_ftconfig_settings_and_run_default_to_the_local_ones():
    from transom.ft import FTConfig

    c = FTConfig()
    assert (c.collective_timeout_s, c.quorum_timeout_s, c.recovery_timeout_s) == \
        (LOCAL.collective_timeout_s, LOCAL.quorum_timeout_s, LOCAL.recovery_timeout_s)
    s = Settings()
    assert (s.heartbeat_timeout_s, s.failed_grace_s, s.round_timeout_s, s.startup_wait_s) == \
        (LOCAL.heartbeat_timeout_s, LOCAL.failed_grace_s, LOCAL.round_timeout_s, LOCAL.startup_wait_s)
    assert s.heartbeat_interval_s == defaults.heartbeat_interval_s(LOCAL.heartbeat_timeout_s)
    run = RunConfig.model_fields  # `transom run`'s flags default to these (flags.py)
    assert (run["collective_timeout_s"].default, run["heartbeat_timeout_s"].default) == \
        (LOCAL.collective_timeout_s, LOCAL.heartbeat_timeout_s)


def test_the_crd_defaults_are_the_cluster_ones():
    ft = api.FaultTolerance()
    assert (ft.collective_timeout_seconds, ft.heartbeat_timeout_seconds) == \
        (CLUSTER.collective_timeout_s, CLUSTER.heartbeat_timeout_s)
    crd = (ROOT / "crds" / "trainingjobs.transom.io.yaml").read_text()
    for field, value in (("collectiveTimeoutSeconds", CLUSTER.collective_timeout_s),
                         ("heartbeatTimeoutSeconds", CLUSTER.heartbeat_timeout_s)):
        assert re.search(rf"{field}:\s*\n\s*default: {int(value)}\b", crd), field


def test_the_docs_tables_of_ftconfig_and_transom_run_agree():
    doc = (ROOT / "docs" / "training-api.md").read_text()
    assert f"| `collective_timeout_s` | {LOCAL.collective_timeout_s} |" in doc
    assert f"| `quorum_timeout_s` | {LOCAL.quorum_timeout_s} |" in doc
    assert f"| `recovery_timeout_s` | {LOCAL.recovery_timeout_s} |" in doc
    assert f"| `--collective-timeout S` | {LOCAL.collective_timeout_s:g} |" in doc
    assert f"| `--heartbeat-timeout S` | {LOCAL.heartbeat_timeout_s:g} |" in doc
