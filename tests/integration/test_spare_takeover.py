"""A hot spare takes over a replica that died, and the job finishes identical.

Real processes, as in a pod: two replicas run `transom launch`; a third launcher runs as a
spare (TRANSOM_SPARE_ID, a labels file standing in for the downward-API volume): its
workers load the model and wait. Replica 1's whole "pod" (launcher and workers) is
SIGKILLed mid-run; then the labels file is rewritten the way the operator's relabel reaches
the kubelet. The spare's waiting workers go on as replica 1 generation 1, catch up from
replica 0, and both finish bit-identical. The same through `transom run --spares`, where
the runner plays the operator: two replicas fail one after the other, and each is taken
over by a worker process that was already running when it failed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launching import EXAMPLE, start_launcher
from run_result import RunResult
from test_fault_tolerance import CAP
from transom import contract
from transom.coordinator.membership import Settings
from transom.coordinator.thread import CoordinatorThread
from transom.launch.supervisor import free_port
from waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:  # ppid
            out.append(int(stat.parent.name))
    return out


def _kill_pod(launcher: subprocess.Popen) -> None:
    """SIGKILL a launcher and its workers (their own sessions), as a pod's death would."""
    for pid in [launcher.pid, *_children(launcher.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.wait(timeout=10)


def test_spare_launcher_takes_over_a_dead_replica(tmp_path):
    port, token = free_port(), "spare-token"
    coordinator = CoordinatorThread(Settings(job="spare", num_replicas=2, min_replicas=1), token, port=port)
    coordinator.start()
    stats = tmp_path / "stats"
    podinfo = tmp_path / "podinfo"
    stats.mkdir()
    podinfo.mkdir()
    (podinfo / "labels").write_text(f'{contract.LABEL_JOB}="spare"\n{contract.LABEL_SPARE}="0"\n'
                                    f'{contract.LABEL_GENERATION}="0"\n')
    launchers = {r: start_launcher(coordinator.url, token, 2, stats, 60, **{contract.ENV_REPLICA_ID: str(r)})
                 for r in range(2)}
    spare = start_launcher(coordinator.url, token, 2, stats, 60,
                           **{contract.ENV_SPARE_ID: "0", contract.ENV_PODINFO_DIR: str(podinfo)})
    try:
        m = coordinator.server.membership
        wait_until(lambda: coordinator.call(lambda: m.status(0).max_step) >= 10, 120, "step 10")
        # The spare's worker runs (it loaded the model) and waits: it has not trained.
        assert spare.poll() is None and not list(stats.glob("steps-r1-g1-*"))
        assert any(_children(spare.pid)), "the spare's worker should be running already"
        _kill_pod(launchers[1])
        tmp = podinfo / "labels.new"
        tmp.write_text(f'{contract.LABEL_JOB}="spare"\n{contract.LABEL_REPLICA}="1"\n'
                       f'{contract.LABEL_GENERATION}="1"\n')
        tmp.rename(podinfo / "labels")
        outputs = [launchers[0].communicate(timeout=150)[0], spare.communicate(timeout=150)[0]]
        assert [launchers[0].returncode, spare.returncode] == [0, 0], "\n".join(o[-2000:] for o in outputs)
    finally:
        for p in [*launchers.values(), spare]:
            if p.poll() is None:
                p.kill()
        coordinator.stop()
    # Replica 0 ran once; replica 1 ran as generation 0 (killed) and then as the spare, generation 1.
    assert sorted(f.name for f in stats.glob("steps-*.jsonl")) == [
        "steps-r0-g0-a0.jsonl", "steps-r1-g0-a0.jsonl", "steps-r1-g1-a0.jsonl"]
    finals = {f.name: json.loads(f.read_text()) for f in stats.glob("final-*.json")}
    assert sorted(finals) == ["final-r0-k0.json", "final-r1-k0.json"]  # written by r1-g1 (r1-g0 was killed)
    assert [f["step"] for f in finals.values()] == [60, 60]
    assert finals["final-r0-k0.json"]["digest"] == finals["final-r1-k0.json"]["digest"]


def _workers(stats: Path, env_has: dict[str, str]) -> list[int]:
    """Pids of this job's worker processes (not launchers) whose environment has `env_has`.
    A worker forked by a warm interpreter shows the interpreter's environment, which is its
    replica's (or its spare's) all the same."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            pairs = environ.read_bytes().decode(errors="replace").split("\0")
            env = dict(kv.split("=", 1) for kv in pairs if "=" in kv)
            argv = (environ.parent / "cmdline").read_bytes().split(b"\0")
            name = (environ.parent / "comm").read_bytes().strip()
        except OSError:
            continue
        worker = (len(argv) > 1 and argv[1].endswith(EXAMPLE.name.encode())) or name == EXAMPLE.name.encode()[:15]
        ours = env.get(contract.ENV_STATS_DIR) == str(stats)
        if worker and ours and all(env.get(k) == v for k, v in env_has.items()):
            found.append(int(environ.parent.name))
    return found


def _last_step_time(path: Path) -> float:
    """The wall time of the last step record in a stats file (0 before the first)."""
    lines = [line for line in path.read_text().splitlines() if line.endswith("}")] if path.exists() else []
    return json.loads(lines[-1])["t"] if lines else 0.0


def test_transom_run_spares_take_over_failed_replicas_with_processes_already_running(tmp_path):
    # Replica 1 is killed at step 12 and spare 0 takes over; once that spare has been started
    # again (after replica 1 caught up), the test SIGKILLs replica 2's worker, which the new
    # spare takes over. The job ends when both have caught up; its step count is only a cap.
    stats, summary, out = tmp_path / "stats", tmp_path / "summary.json", tmp_path / "output.txt"
    cmd = [sys.executable, "-m", "transom", "run", "--replicas", "3", "--spares", "1",
           "--inject", "kill:replica=1,step=12,phase=forward", "--end-on", "caught_up:1", "--end-on", "caught_up:2",
           "--summary-json", str(summary), "--stats-dir", str(stats), "--timeout", "200",
           "--", sys.executable, str(EXAMPLE), *CAP]
    with out.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=dict(os.environ, OMP_NUM_THREADS="1"), stdout=sink,
                                stderr=subprocess.STDOUT)
    try:
        respawned = {contract.ENV_PODINFO_DIR: str(stats / "podinfo" / "spare-0-g1")}
        wait_until(lambda: _workers(stats, respawned) or proc.poll() is not None, 100, "spare 0 started again")
        # The test reads replica 2's death as its last step: let it step once after the spare's start.
        started = time.time()
        wait_until(lambda: _last_step_time(stats / "steps-r2-g0-a0.jsonl") > started or proc.poll() is not None,
                   60, "a step of replica 2 after the spare's start")
        victims = _workers(stats, {contract.ENV_REPLICA_ID: "2"})
        assert victims and proc.poll() is None, out.read_text()[-3000:]
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
    assert summary.exists(), out.read_text()[-3000:]
    result = RunResult(proc.returncode, json.loads(summary.read_text()), out.read_text(), stats)
    result.assert_finished_together(3)
    for replica in (1, 2):
        # Two generations: the failed one, and the spare that took over. The failed one's
        # launcher may restart its worker in place before it is stopped: that attempt is
        # refused as superseded and trains nothing.
        files = sorted(result.stats_dir.glob(f"steps-r{replica}-g*-a*.jsonl"))
        assert {p.name.split("-")[2] for p in files} == {"g0", "g1"}, result.output[-3000:]
        assert [p.name for p in files if "-g1-" in p.name] == [f"steps-r{replica}-g1-a0.jsonl"]
        assert not [p for p in files if "-g0-a0" not in p.name and "-g1-" not in p.name and
                    any(json.loads(line).get("committed") for line in p.read_text().splitlines() if line.endswith("}"))]
        assert f"replica {replica} failed" in result.output and "spare 0 takes over" in result.output
        steps = sorted(result.stats_dir.glob(f"steps-r{replica}-g*-a0.jsonl"))
        first, second = ([json.loads(line) for line in p.read_text().splitlines() if line.endswith("}")]
                         for p in steps)
        died = first[-1]["t"]
        # No process start on the recovery path: the process that took over was running
        # before the replica died (the second one is the spare started again after the first).
        assert second[0]["process_started"] < died, (second[0]["process_started"], died)
        assert any(r["committed"] and r["recovering"] for r in second), "the spare catches up as a joiner"
    assert result.incarnations(0) == 1
