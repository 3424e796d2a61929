"""How a worker hands a ScriptError to its launcher (transom/script_errors.py), in real
interpreters without torch: the hook records a ScriptError that escapes, and nothing else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from transom import contract, errors, script_errors

ROOT = Path(__file__).resolve().parents[2]


def run_script(code: str, tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    environ = {"PYTHONPATH": str(ROOT / "launcher"), "RANK": "1", **env}
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("raised, recorded", [
    ("errors.UsageError('a second backward pass')", ("UsageError", "a second backward pass")),
    ("errors.IncompatibleCheckpoint('sharded over 8 ranks')", ("IncompatibleCheckpoint", "sharded over 8 ranks")),
    ("RuntimeError('a crash')", None),
    ("errors.BackendError('no GPU')", None),  # may be the node's doing: retried
], ids=["usage", "checkpoint", "crash", "backend"])
def test_an_escaping_script_error_is_recorded_and_the_traceback_still_printed(tmp_path, raised, recorded):
    out = tmp_path / "error.json"
    code = (f"from transom import errors, script_errors\n"
            f"script_errors.install_hook()\nscript_errors.install_hook()\nraise {raised}")
    proc = run_script(code, tmp_path, **{contract.ENV_SCRIPT_ERROR_FILE: str(out)})
    assert proc.returncode == 1 and "Traceback" in proc.stderr and proc.stderr.count("Traceback") == 1
    found = script_errors.read(out)
    assert (None if found is None else (found.kind, found.message)) == recorded
    if found is not None:
        assert found.rank == 1


def test_an_error_on_its_way_through_finally_is_recorded_before_it_escapes(tmp_path):
    out = tmp_path / "error.json"
    code = ("import os\nfrom transom import errors, script_errors\n"
            "try:\n    raise errors.UsageError('x')\nfinally:\n    script_errors.record_escaping()\n"
            f"    print(os.path.exists({str(out)!r}))\n")
    proc = run_script(code, tmp_path, **{contract.ENV_SCRIPT_ERROR_FILE: str(out)})
    assert proc.stdout.strip() == "True" and script_errors.read(out).kind == "UsageError"


def test_nothing_is_recorded_without_a_launcher(tmp_path):
    proc = run_script("from transom import errors, script_errors\nscript_errors.install_hook()\n"
                      "raise errors.UsageError('x')", tmp_path)
    assert proc.returncode == 1 and "UsageError: x" in proc.stderr and list(tmp_path.iterdir()) == []


def test_what_is_not_a_record_reads_as_none(tmp_path):
    bad = tmp_path / "bad.json"
    for text in ["", "{", "[]", '{"kind": "UsageError"}', "\xff"]:
        bad.write_text(text)
        assert script_errors.read(bad) is None
    assert script_errors.read(tmp_path / "missing.json") is None


def test_the_family_says_what_ends_a_job():
    assert issubclass(errors.UsageError, errors.ScriptError) and issubclass(errors.UsageError, RuntimeError)
    assert issubclass(errors.IncompatibleCheckpoint, errors.ScriptError)
    assert issubclass(errors.IncompatibleCheckpoint, errors.CheckpointError)
    assert not issubclass(errors.BackendError, errors.ScriptError)
    assert not issubclass(errors.CorruptCheckpoint, errors.ScriptError)


def test_the_termination_log_is_written_where_asked_and_bounded(tmp_path):
    path = tmp_path / "termination"
    script_errors.write_termination_log("x" * 10_000, {contract.ENV_TERMINATION_LOG: str(path)})
    assert script_errors.read_termination_log(path) == "x" * script_errors.MAX_MESSAGE_CHARS
    script_errors.write_termination_log("ignored", {})  # nowhere asked: nothing, no error
    assert script_errors.read_termination_log(tmp_path / "none") is None
