"""Workers forked by a warm interpreter (launch/warm_start.py) in a real `transom run`: they
start with torch imported, as `python SCRIPT` would have started them otherwise, and a
SIGKILLed replica's restart comes from it too; `TRANSOM_WARM_START=0` starts them fresh."""

from __future__ import annotations

import json
import os
from pathlib import Path

from transom import contract

PROBE = Path(__file__).parent / "scripts" / "warm_probe.py"
SMALL = ["--dim", "32", "--layers", "1"]


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_workers_and_a_killed_replicas_restart_are_forked_warm_and_start_as_python_script(
        transom_run, tmp_path, monkeypatch):
    out = tmp_path / "probe.jsonl"
    monkeypatch.setenv("WARM_PROBE_OUT", str(out))
    result = transom_run(["--replicas", "2", "--nproc-per-replica", "2", "--inject", "kill:replica=1,step=4,rank=0",
                          "--end-on", "caught_up:1", "--end-margin", "2"],
                         ["--steps", "300", "--inner", "ddp", *SMALL], script=PROBE)
    assert result.returncode == 0, result.output[-3000:]
    assert result.summary["replicas_bit_identical"], result.summary
    records = _records(out)
    # 2 replicas x 2 ranks, and replica 1's two workers again: attempt 1.
    assert sorted((r["attempt"], r["rank"]) for r in records) == \
        [("0", "0"), ("0", "0"), ("0", "1"), ("0", "1"), ("1", "0"), ("1", "1")], records
    for r in records:
        assert r["warm"] and r["name"] == "__main__" and r["session_leader"], r
        assert r["argv"] == [str(PROBE), "--steps", "300", "--inner", "ddp", *SMALL], r
        assert r["path0"] == str(PROBE.parent) and Path(r["cwd"]).parent == tmp_path, r
    # The launcher is every worker's parent (re-parented from the warm interpreter's fork).
    assert len({r["parent"] for r in records}) == 2, records
    # Each draws its own seeds, as a new process does.
    assert len({r["numpy"] for r in records}) == len(records) and len({r["random"] for r in records}) == len(records)
    # Nothing of the run is left: its warm interpreters stopped with their launchers.
    leftovers = [p for p in os.listdir("/proc") if p.isdigit() and
                 "transom.launch.warm_interpreter" in _cmdline(p) and str(tmp_path) in _environ_of(p)]
    assert not leftovers


def test_warm_start_0_starts_every_worker_as_a_new_process(transom_run, tmp_path, monkeypatch):
    out = tmp_path / "probe.jsonl"
    monkeypatch.setenv("WARM_PROBE_OUT", str(out))
    monkeypatch.setenv(contract.ENV_WARM_START, "0")
    result = transom_run(["--replicas", "2"], ["--steps", "3", *SMALL], script=PROBE)
    assert result.returncode == 0, result.output[-3000:]
    records = _records(out)
    assert len(records) == 2 and not any(r["warm"] for r in records), records


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _environ_of(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
    except OSError:
        return ""
