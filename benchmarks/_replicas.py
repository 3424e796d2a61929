"""How the comparison benchmarks start N data-parallel replicas of one workload on this
machine, for each system they compare (not a benchmark itself).

- Transom: `transom run` on loopback (hot spares with `--spares`); or, in network
  namespaces (benchmarks/netns.py), what `transom run` does spelled out: the coordinator
  on the bridge, each replica's `transom launch` inside its namespace, and the runner's
  part (promoting a spare when the coordinator declares a replica failed) done here.
- torchft 0.2.0: its lighthouse and one worker per replica running its manual loop; a
  worker killed by the fault is started again, as its launcher would. torchft-nightly
  (`torchft_nightly`) the same way, from its own directory (`nightly_env`).
- DDP: one `init_process_group("gloo")` world over the same processes (loopback only).

Every worker runs benchmarks/scripts/<system>_worker.py and writes the per-step log of
benchmarks/scripts/workload.py into `out`. Every process is bounded by `timeout_s` and
killed with its whole tree afterwards, whatever happened.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from _common import REPO, descendants, kill_known, run_bounded
from netns import Cluster

SCRIPTS = Path(__file__).resolve().parent / "scripts"


@dataclass
class Job:
    """One run: `replicas` replicas of `model` for `steps` steps, logs into `out`."""

    out: Path
    model: str
    steps: int
    replicas: int = 3
    timeout_s: float = 400.0
    kill: tuple[int, int] | None = None  # (replica, step): SIGKILLed in that step's forward pass
    spares: int = 0  # Transom only
    net: Cluster | None = None
    env: dict[str, str] = field(default_factory=dict)

    def worker(self, system: str) -> list[str]:
        return [sys.executable, str(SCRIPTS / f"{system}_worker.py"), "--steps", str(self.steps),
                "--model", self.model]

    def base_env(self) -> dict[str, str]:
        return {**os.environ, "BENCH_OUT": str(self.out), "OMP_NUM_THREADS": os.environ.get("BENCH_THREADS", "1"),
                **self.env}


@dataclass
class Outcome:
    ok: bool
    detail: str = ""  # what went wrong, with the end of the output
    bit_identical: bool | None = None  # Transom: every replica ended with the same parameters

    @staticmethod
    def of(ok: bool, what: str, log: Path, bit_identical: bool | None = None) -> Outcome:
        return Outcome(ok, "" if ok else f"{what}; output tail:\n{log.read_text(errors='replace')[-2500:]}",
                       bit_identical)


# --- Transom ------------------------------------------------------------------------------------
def run_transom(job: Job) -> Outcome:
    return _transom_netns(job) if job.net is not None else _transom_local(job)


def _transom_local(job: Job) -> Outcome:
    cmd = [sys.executable, "-m", "transom", "run", "--replicas", str(job.replicas), "--quiet",
           "--timeout", str(job.timeout_s), "--summary-json", str(job.out / "summary.json")]
    if job.kill is not None:
        cmd += ["--inject", f"kill:replica={job.kill[0]},step={job.kill[1]},phase=forward"]
    if job.spares:
        cmd += ["--spares", str(job.spares)]
    res = run_bounded([*cmd, "--", *job.worker("transom")], job.timeout_s + 30, job.out / "run.log", job.base_env())
    summary = job.out / "summary.json"
    identical = json.loads(summary.read_text()).get("replicas_bit_identical") if summary.exists() else None
    return Outcome.of(res.returncode == 0, f"transom run exited {res.returncode}", job.out / "run.log", identical)


def _transom_netns(job: Job) -> Outcome:
    net = job.net
    assert net is not None and net.replicas >= job.replicas + job.spares
    token = secrets.token_hex(16)
    (job.out / "token").write_text(token)
    port = _free_port(net.host_addr)
    url = f"http://{net.host_addr}:{port}"
    seen: dict[int, int] = {}
    with open(job.out / "run.log", "w") as log:
        coordinator = subprocess.Popen(
            [sys.executable, "-m", "transom", "coordinator", "--host", net.host_addr, "--port", str(port),
             "--replicas", str(job.replicas), "--job", "bench", "--token-file", str(job.out / "token")],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
        launchers: dict[int, subprocess.Popen] = {}
        spares: list[tuple[subprocess.Popen, Path]] = []
        retired: list[subprocess.Popen] = []  # launchers of replicas a spare took over

        def launch(slot: int, identity: dict[str, str], fault: str = "") -> subprocess.Popen:
            env = {**job.base_env(), **_pod_env(job.replicas, url, token), **identity,
                   "TRANSOM_ADVERTISE_ADDR": net.addr(slot), "GLOO_SOCKET_IFNAME": net.interface(slot),
                   "TRANSOM_FAULT": fault, "TRANSOM_OWNER_PID": str(os.getpid()),
                   "TRANSOM_STATS_DIR": str(job.out / "stats")}  # the final digests
            return subprocess.Popen([*net.prefix(slot), sys.executable, "-m", "transom", "launch", "--nproc-per-node",
                                     "1", "--", *job.worker("transom")],
                                    env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)

        try:
            _wait_http(f"{url}/healthz", 30)
            for r in range(job.replicas):
                fault = f"kill:step={job.kill[1]},phase=forward" if job.kill and job.kill[0] == r else ""
                launchers[r] = launch(r, {"TRANSOM_REPLICA_ID": str(r)}, fault)
            for k in range(job.spares):
                podinfo = job.out / f"podinfo-{k}"
                podinfo.mkdir()
                _write_labels(podinfo, {"transom.io/spare": str(k)})
                spares.append((launch(job.replicas + k, {"TRANSOM_SPARE_ID": str(k),
                                                         "TRANSOM_PODINFO_DIR": str(podinfo)}), podinfo))

            def promote() -> None:
                """The runner's part: a replica the coordinator declared failed gets a spare."""
                for replica in _failed(url, token):
                    if not spares or replica not in launchers:
                        continue
                    proc, podinfo = spares.pop(0)
                    launchers[replica].terminate()
                    retired.append(launchers[replica])
                    _write_labels(podinfo, {"transom.io/replica": str(replica), "transom.io/generation": "1"})
                    launchers[replica] = proc

            codes = _supervise(launchers, seen, time.monotonic() + job.timeout_s, tick=promote if spares else None)
        finally:
            for p in [*launchers.values(), *(p for p, _ in spares), *retired, coordinator]:
                if p.poll() is None:
                    p.kill()
            coordinator.wait()
            kill_known(seen)
    ok = codes == {r: 0 for r in range(job.replicas)}
    finals = [json.loads(p.read_text()) for p in (job.out / "stats").glob("final-r*-k0.json")]
    identical = len(finals) == job.replicas and len({f["digest"] for f in finals}) == 1
    return Outcome.of(ok, f"launcher exit codes {codes}", job.out / "run.log", identical)


def _pod_env(replicas: int, url: str, token: str) -> dict[str, str]:
    """A replica's pod environment (transom/contract.py) besides its identity."""
    return {"TRANSOM_JOB": "bench", "TRANSOM_NAMESPACE": "bench", "TRANSOM_NUM_REPLICAS": str(replicas),
            "TRANSOM_REPLICA_GENERATION": "0", "TRANSOM_NODE_RANK": "0", "TRANSOM_NNODES": "1",
            "TRANSOM_NPROC_PER_NODE": "1", "TRANSOM_COORDINATOR_URL": url, "TRANSOM_COORDINATOR_TOKEN": token,
            "TRANSOM_BACKEND": "gloo"}


def _failed(url: str, token: str) -> list[int]:
    """The replicas the coordinator holds failed now (its /v1/status)."""
    req = urllib.request.Request(f"{url}/v1/status", headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=2) as resp:
            status = json.loads(resp.read())
    except OSError:
        return []
    return [r["replica_id"] for r in status.get("replicas", []) if r.get("state") == "failed"]


def _write_labels(directory: Path, labels: dict[str, str]) -> None:
    tmp = directory / "labels.tmp"
    tmp.write_text("".join(f"{k}={json.dumps(v)}\n" for k, v in labels.items()))
    tmp.rename(directory / "labels")


# --- torchft ------------------------------------------------------------------------------------
def run_torchft(job: Job) -> Outcome:
    """torchft's replicas; a worker killed by the fault is started again, as a launcher would."""
    seen: dict[int, int] = {}
    host = job.net.host_addr if job.net else "127.0.0.1"
    with open(job.out / "run.log", "w") as log:
        lighthouse, address = _lighthouse(log, host, job.base_env())
        env = {**job.base_env(), "TORCHFT_LIGHTHOUSE": address,
               "BENCH_KILL_STEP": str(job.kill[1]) if job.kill else "-1"}
        killed = job.kill[0] if job.kill else None

        def start(replica: int, attempt: int) -> subprocess.Popen:
            e = {**env, "REPLICA_ID": str(replica), "BENCH_ATTEMPT": str(attempt if replica == killed else 1)}
            prefix: list[str] = []
            if job.net is not None:
                e.update(BENCH_HOST=job.net.addr(replica), GLOO_SOCKET_IFNAME=job.net.interface(replica))
                prefix = job.net.prefix(replica)
            return subprocess.Popen([*prefix, *job.worker("torchft")], env=e, stdout=log, stderr=subprocess.STDOUT,
                                    cwd=REPO, start_new_session=True)

        restarted: list[int] = []

        def restart(replica: int, code: int) -> subprocess.Popen | None:
            if code == -signal.SIGKILL and replica == killed and not restarted:
                restarted.append(replica)
                return start(replica, 1)
            return None

        procs = {r: start(r, 0) for r in range(job.replicas)}
        try:
            codes = _supervise(procs, seen, time.monotonic() + job.timeout_s, restart=restart)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
            lighthouse.kill()
            lighthouse.wait()
            kill_known(seen)
    ok = codes == {r: 0 for r in range(job.replicas)}
    return Outcome.of(ok, f"worker exit codes {codes}", job.out / "run.log")


def _lighthouse(log, host: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    code = ("from torchft.coordination import LighthouseServer; import time; "
            f"s = LighthouseServer(bind='{host}:0', min_replicas=1, join_timeout_ms=1000, quorum_tick_ms=100); "
            "print(s.address(), flush=True); time.sleep(3600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True, env=env)  # env: which torchft (nightly_env)
    assert proc.stdout is not None  # stdout=PIPE
    address = proc.stdout.readline().strip()  # the server prints it once it listens
    if not address:
        proc.kill()
        raise RuntimeError("the torchft lighthouse did not start (see its log)")
    # It names itself by the machine's host name, which a replica in a namespace cannot
    # reach: the address it is bound to is the one to give.
    return proc, f"http://{host}:{address.rsplit(':', 1)[1]}"


# --- DDP ----------------------------------------------------------------------------------------
def run_ddp(job: Job) -> Outcome:
    """One torch.distributed world of `replicas` processes (loopback), started under one small
    parent so that run_bounded can bound and clean up all of them."""
    assert job.net is None and job.kill is None, "plain DDP runs only failure-free on loopback"
    spawn = ("import os, subprocess, sys\n"
             "cmd, n = sys.argv[2:], int(sys.argv[1])\n"
             "ps = [subprocess.Popen(cmd, env={**os.environ, 'RANK': str(r), 'LOCAL_RANK': str(r)})\n"
             "      for r in range(n)]\n"
             "sys.exit(max(abs(p.wait()) for p in ps))\n")
    env = {**job.base_env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port("127.0.0.1")),
           "WORLD_SIZE": str(job.replicas)}
    res = run_bounded([sys.executable, "-c", spawn, str(job.replicas), *job.worker("ddp")], job.timeout_s,
                      job.out / "run.log", env)
    return Outcome.of(res.returncode == 0, f"exited {res.returncode}", job.out / "run.log")


RUNNERS = {"transom": run_transom, "torchft": run_torchft, "ddp": run_ddp}

# torchft-nightly, installed by `make bench-deps` into a directory of its own: it is the same
# `torchft` package, so it cannot sit beside 0.2.0 in the venv; its runs put it first on
# PYTHONPATH (the same worker script, the same lighthouse code). It needs torch >= 2.7 only.
TORCHFT_NIGHTLY = REPO / ".cache" / "torchft-nightly"
NIGHTLY = "torchft_nightly"  # the system's name in the figures; its workers log as "torchft"


def nightly_installed() -> bool:
    return (TORCHFT_NIGHTLY / "torchft" / "__init__.py").is_file()


def nightly_env() -> dict[str, str]:
    """The environment of a torchft-nightly run's processes."""
    if not nightly_installed():
        raise SystemExit(f"torchft-nightly is not in {TORCHFT_NIGHTLY}: run `make bench-deps`")
    return {"PYTHONPATH": os.pathsep.join(p for p in (str(TORCHFT_NIGHTLY), os.environ.get("PYTHONPATH")) if p)}


# --- helpers ------------------------------------------------------------------------------------
def _supervise(procs: dict[int, subprocess.Popen], seen: dict[int, int], deadline: float,
               restart=None, tick=None) -> dict[int, int]:
    """Wait (bounded) for every process in `procs` to exit; `restart(replica, code)` may give a
    replacement, `tick()` runs on every poll and may change `procs`."""
    codes: dict[int, int] = {}
    while len(codes) < len(procs) and time.monotonic() < deadline:
        if tick is not None:
            tick()
        for r, p in list(procs.items()):
            seen.update(descendants(p.pid))
            code = p.poll()
            if code is None or r in codes:
                continue
            replacement = restart(r, code) if restart is not None else None
            if replacement is not None:
                procs[r] = replacement
            else:
                codes[r] = code
        time.sleep(0.05)
    return codes


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _wait_http(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)
