"""The pre-flight checks (transom/check), run for real on the CPU: the seeded matmul, the
memory pattern, a Gloo all-reduce among child processes, a GET from a real state server,
a probe object in a temporary directory, the disk and a clock read from a real HTTP Date
header. Small sizes keep the file within seconds; no torch call is mocked.
"""

from __future__ import annotations

import email.utils
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest

from transom import contract, inject
from transom.check import CheckContext, CheckResult, failure_message, node, run_checks
from transom.check import collective as collective_check
from transom.ft.state_server import StateServer
from transom.launch.rendezvous import free_port

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"memory_bytes": 16 << 20}


def _children() -> set[int]:
    """Pids of this process's living children (zombies included: an unreaped child counts).
    Compare before and after: in a whole test session this process has children of its own
    (the test environment's control plane)."""
    me, out = os.getpid(), set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == me:
            out.add(int(stat.parent.name))
    return out


class _Clock(BaseHTTPRequestHandler):
    """/healthz with a Date header `offset_s` off this machine's clock (a coordinator's)."""

    offset_s = 0.0

    def do_GET(self):
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()
        self.wfile.write(b"ok")

    def date_time_string(self, timestamp=None):
        return email.utils.formatdate(time.time() + self.offset_s, usegmt=True)

    def log_message(self, *args):
        pass


@pytest.fixture
def coordinator_clock():
    servers = []

    def start(offset_s: float = 0.0, port: int = 0) -> str:
        handler = type("Clock", (_Clock,), {"offset_s": offset_s})
        server = ThreadingHTTPServer(("127.0.0.1", port), handler)
        Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture
def peer():
    server = StateServer(token="peer-secret")
    yield server.url
    server.close()


def by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


def test_every_check_passes_on_the_cpu(tmp_path, coordinator_clock, peer):
    context = CheckContext(nproc=2, checkpoint_uri=str(tmp_path / "ckpt"), snapshot_bytes=1 << 20,
                           snapshot_dir=str(tmp_path), coordinator_url=coordinator_clock(), peer_url=peer,
                           peer_token="peer-secret", **SMALL)
    before = _children()
    results = run_checks(context, timeout_s=60)
    assert [r.name for r in results] == list(contract.PREFLIGHT_CHECKS)
    assert all(r.passed and not r.skipped for r in results), [r.message for r in results]
    found = by_name(results)
    assert found["compute"].value is not None and found["compute"].value < 1e-5
    assert found["memory"].value == 0
    assert found["collective"].value is not None and found["collective"].value > 0  # GB/s
    assert found["link"].value is not None and 0 < found["link"].value < 1000  # ms
    assert found["node"].value is not None and found["node"].value >= 1 << 20  # free bytes
    assert failure_message(results) is None
    assert json.loads(json.dumps([r.to_json() for r in results]))[0]["name"] == "compute"
    assert _children() - before == set()


def test_what_does_not_apply_is_skipped_and_counts_as_passed():
    results = run_checks(CheckContext(**SMALL), names=("collective", "link", "storage"))
    assert all(r.passed and r.skipped for r in results)
    assert "one process" in by_name(results)["collective"].message
    assert failure_message(results) is None


def test_an_injected_corrupt_fault_fails_compute_with_its_value():
    fault = inject.Fault.parse("corrupt:step=1,count=2")
    for run_index, corrupted in ((0, False), (1, True), (2, True), (3, False)):
        [result] = run_checks(CheckContext(faults=(fault,), run_index=run_index), names=("compute",))
        assert result.passed is not corrupted, (run_index, result.message)
    assert not result.skipped and result.value is not None and result.value < 1e-4
    [result] = run_checks(CheckContext(faults=(fault,), run_index=1), names=("compute",))
    assert result.value is not None and result.value > 1.0
    assert result.message.startswith("compute: ") and f"{result.value:.3g}" in result.message
    assert "1e-04" in result.message
    message = failure_message([result])
    assert message is not None and message.startswith("PreflightFailed: compute: ")


def test_a_collective_past_its_budget_times_out_and_leaves_no_process():
    before, started = _children(), time.monotonic()
    [result] = run_checks(CheckContext(nproc=2), names=("collective",), timeout_s=0.5)
    assert not result.passed and "timed out after 0.5 s" in result.message
    assert time.monotonic() - started < 0.5 + collective_check.REAP_S
    assert _children() - before == set()


def test_a_check_past_its_budget_is_abandoned_and_the_rest_get_nothing():
    results = run_checks(CheckContext(memory_bytes=1 << 30), names=("memory", "node"), timeout_s=0.2)
    assert [r.passed for r in results] == [False, False]
    assert "timed out after 0.2 s" in results[0].message and "not run" in results[1].message


def test_storage_leaves_nothing_behind(tmp_path):
    [result] = run_checks(CheckContext(checkpoint_uri=f"file://{tmp_path}"), names=("storage",))
    assert result.passed and result.value is not None and result.value < 10
    assert list(tmp_path.iterdir()) == []


def test_storage_that_cannot_be_written_fails_and_leaves_nothing(tmp_path):
    (tmp_path / ".transom-preflight").write_text("a file where the probe's directory belongs")
    [result] = run_checks(CheckContext(checkpoint_uri=str(tmp_path)), names=("storage",))
    assert not result.passed and result.message.startswith("storage: failed: ")
    assert [p.name for p in tmp_path.iterdir()] == [".transom-preflight"]


def test_node_fails_on_too_little_disk_and_on_a_skewed_clock(tmp_path, coordinator_clock):
    [full] = run_checks(CheckContext(snapshot_bytes=1 << 60, snapshot_dir=str(tmp_path)), names=("node",))
    assert not full.passed and "GiB free" in full.message
    [skewed] = run_checks(CheckContext(coordinator_url=coordinator_clock(offset_s=60)), names=("node",))
    assert not skewed.passed and skewed.value is not None and 57 < skewed.value < 61
    assert "clock skew <= 5 s" in skewed.message
    [fine] = run_checks(CheckContext(coordinator_url=coordinator_clock(offset_s=0.5)), names=("node",))
    assert fine.passed, fine.message


def test_node_does_not_blame_itself_for_a_coordinator_that_does_not_answer(monkeypatch):
    # A job's coordinator starts with its first pods: one not listening yet is not a bad node.
    monkeypatch.setattr(node, "CLOCK_PATIENCE_S", 1.0)
    began = time.monotonic()
    [result] = run_checks(CheckContext(coordinator_url="http://127.0.0.1:9"), names=("node",))
    assert result.passed and "clock not compared (coordinator http://127.0.0.1:9 did not answer)" in result.message
    assert time.monotonic() - began < 5


def test_node_reads_the_clock_of_a_coordinator_that_starts_late(coordinator_clock):
    port = free_port()
    late = Thread(target=lambda: (time.sleep(1.0), coordinator_clock(offset_s=60, port=port)), daemon=True)
    late.start()
    [skewed] = run_checks(CheckContext(coordinator_url=f"http://127.0.0.1:{port}"), names=("node",))
    late.join()
    assert not skewed.passed and "clock skew <= 5 s" in skewed.message


def test_link_fails_with_the_wrong_token_or_no_peer(peer):
    [refused] = run_checks(CheckContext(peer_url=peer, peer_token="wrong"), names=("link",))
    assert not refused.passed and "401" in refused.message
    [gone] = run_checks(CheckContext(peer_url="http://127.0.0.1:9"), names=("link",))
    assert not gone.passed and "unreachable" in gone.message


def test_failure_message_is_one_bounded_line():
    many = [CheckResult("memory", False, 0.1, 3.0, "0 mismatching elements", "memory: " + "x" * 900)] * 3
    message = failure_message(many)
    assert message is not None and len(message) == 1024 and message.startswith("PreflightFailed: memory: ")


def test_unknown_checks_and_bad_contexts_are_refused():
    with pytest.raises(ValueError, match="the checks are compute, memory"):
        run_checks(CheckContext(), names=("compute", "gpu"))
    with pytest.raises(ValueError, match="device"):
        CheckContext(device="tpu")
    with pytest.raises(ValueError, match="nproc"):
        CheckContext(nproc=0)


def test_inject_parses_corrupt_and_node():
    assert inject.Fault.parse("corrupt:step=0") == inject.Fault("corrupt", 0, phase="preflight")
    assert inject.Fault.parse("corrupt:step=2,phase=preflight,count=3,node=gpu-7.example") == inject.Fault(
        "corrupt", 2, phase="preflight", count=3, node="gpu-7.example")
    assert inject.Fault.parse("kill:step=5,node=n1").node == "n1"


@pytest.mark.parametrize("text, message", [
    ("corrupt:step=0,phase=allreduce", "only in phase preflight"),
    ("kill:step=0,phase=preflight", "only corrupt"),
    ("nan:step=0,phase=preflight", "only corrupt"),
    ("corrupt:step=x", "step"),
    ("kill:step=1,node=Node_1", "node name"),
    ("kill:step=1,node=", "node name"),
])
def test_inject_refuses_bad_preflight_and_node_faults(text, message):
    with pytest.raises(ValueError, match=message):
        inject.Fault.parse(text)


def test_preflight_faults_are_those_for_this_node_and_replica():
    environ = {contract.ENV_FAULT: "kill:step=3;corrupt:step=0,node=n1;corrupt:step=1,node=n2;"
                                   "corrupt:step=2,replica=1;corrupt:step=4",
               contract.ENV_NODE_NAME: "n1", contract.ENV_REPLICA_ID: "0"}
    assert [f.step for f in inject.preflight_faults(environ)] == [0, 4]
    assert [f.step for f in inject.preflight_faults({**environ, contract.ENV_REPLICA_ID: "1"})] == [0, 2, 4]
    assert [f.step for f in inject.preflight_faults({contract.ENV_FAULT: environ[contract.ENV_FAULT]})] == [4]
    # The step's faults: a pre-flight entry is not one, and node= holds for them too.
    assert inject.from_environ(1, environ) is None
    assert inject.from_environ(0, environ) == inject.Fault("kill", 3)
    assert inject.from_environ(0, {contract.ENV_FAULT: "kill:step=3,node=n2", contract.ENV_NODE_NAME: "n1"}) is None


def _transom(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "transom", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "launcher"), **(env or {})})


def test_transom_check_json_exits_0_and_prints_one_object():
    done = _transom("check", "--json", "--checks", "compute,memory,node", "--memory-mb", "16")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["passed"] is True and [c["name"] for c in report["checks"]] == ["compute", "memory", "node"]
    assert report["seconds"] >= sum(c["seconds"] for c in report["checks"]) - 0.01


def test_transom_check_fails_with_its_exit_code_and_refuses_unknown_checks():
    failed = _transom("check", "--checks", "compute", env={contract.ENV_FAULT: "corrupt:step=0"})
    assert failed.returncode == contract.EXIT_PREFLIGHT_FAILED
    assert "compute" in failed.stdout and "FAIL" in failed.stdout
    unknown = _transom("check", "--checks", "compute,gpu")
    assert unknown.returncode == 2
    assert "unknown check 'gpu'" in unknown.stderr and "compute,memory,collective,link,storage,node" in unknown.stderr


def test_importing_transom_check_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import transom.check, transom.cli\n"
            "transom.cli.parser().parse_args(['check', '--checks', 'node'])\n"
            "from transom.check import run_checks, CheckContext\n"
            "print(run_checks(CheckContext(), names=('node', 'storage'))[0].passed)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT / "launcher")})
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr
