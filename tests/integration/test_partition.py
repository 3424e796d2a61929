"""A partitioned incarnation, healed after its replacement joined, is fenced.

Real processes, as pods run them: a coordinator on loopback, two replicas under `transom
launch` writing checkpoints to a directory. Replica 1's worker stops itself in the middle
of the checkpoint of step 10, once its snapshot is taken and before the first byte of its
part is written (`stop:step=10,phase=checkpoint`: SIGSTOP of the whole process, every
thread frozen where it is, as a node cut off from the network or a paused VM); the test
stops its launcher too. It stays stopped past the heartbeat timeout: the coordinator
declares it failed, replica 0 trains on alone, and the replica's next generation registers
and joins. Then the old incarnation is woken (SIGCONT), a zombie: its checkpoint thread goes
on to write its part, and its training thread to ask for the quorum of its next step.

Both are refused. Its part never reaches storage (nothing at all appears under step 10
after the replacement joined), it commits no step its peers did not commit with it, the
coordinator counted the refusals and recorded them as events, and its log says "fenced".
Without the fence its part lands in the checkpoint (checked by hand: see docs/failure-model.md).

Its launcher is woken only after the zombie's worker has exited: in a real partition the
launcher's view of the coordinator (a long-poll on a connection that may hang until its
socket timeout, 65 s) can come back later than the worker's own threads, and the fence is
what stops the worker meanwhile.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from launching import kill_all, start_launcher
from transom import contract
from transom.coordinator.membership import Settings
from transom.coordinator.models import Identity
from transom.coordinator.thread import CoordinatorThread
from waiting import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "small_job.py"
TOKEN = "partition-token"
FIRST = Identity(replica_id=0, generation=0, attempt=0)
ZOMBIE, REPLACEMENT = Identity(replica_id=1, generation=0, attempt=0), Identity(replica_id=1, generation=1, attempt=0)


def process_state(pid: int) -> str | None:
    """The kernel's state letter of `pid` (R, S, T stopped, Z exited and not reaped), None once gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def stopped_child_of(parent: int) -> int | None:
    """A child of `parent` that is stopped (state T): the worker, not its warm interpreter."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[1]) == parent and fields[0] == "T":
                    return int(entry.name)
            except (OSError, IndexError, ValueError):
                pass
    return None


def files_under(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if root.exists() else set()


def committed(stats_dir: Path, identity: Identity) -> set[tuple[int, int]]:
    """(step, quorum id) of every step this incarnation committed, from its worker's records."""
    path = stats_dir / f"steps-r{identity.replica_id}-g{identity.generation}-a{identity.attempt}.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # a line cut short
    return {(r["step"], r["quorum_id"]) for r in rows if r.get("committed")}


def cut_off(zombie_launcher, coordinator: CoordinatorThread) -> int:
    """The cut: replica 1's worker stops itself mid-checkpoint, its launcher goes with it, and
    the coordinator declares the replica failed. The stopped worker's pid."""
    m = coordinator.server.membership
    wait_until(lambda: stopped_child_of(zombie_launcher.pid) is not None, 120,
               "replica 1 stopped in the middle of the checkpoint of step 10")
    worker = stopped_child_of(zombie_launcher.pid)
    assert worker is not None
    zombie_launcher.send_signal(signal.SIGSTOP)
    wait_until(lambda: coordinator.call(lambda: m.replicas[1].state) == "failed", 30,
               "replica 1 declared failed after the heartbeat timeout")
    return worker


def assert_refused(coordinator: CoordinatorThread, output: str, counted: dict[str, int]) -> None:
    """The zombie was told it is fenced, and the coordinator counted and recorded its refusals
    (`counted`: the counts before it woke)."""
    server, m = coordinator.server, coordinator.server.membership
    assert "fenced: replica 1 generation 0 attempt 0 was superseded; checkpoint part 1 of step 10 not written" \
        in output, output[-3000:]
    after = coordinator.call(lambda: dict(server.refusals.counts))
    assert after.get("/v1/fence", 0) > counted.get("/v1/fence", 0), (counted, after)
    asked = ("/v1/quorum", "/v1/heartbeat")  # it tried to take part in a step again, after it woke
    assert sum(after.get(e, 0) - counted.get(e, 0) for e in asked) >= 1, (counted, after)
    events = [e.message for e in coordinator.call(lambda: m.status(0).events) if e.kind == "refused"]
    assert "refused replica 1 generation 0 attempt 0 on /v1/fence (write checkpoint part 1 of step 10): " \
           "superseded by generation 1 attempt 0" in events, events


def test_a_partitioned_incarnation_healed_after_its_replacement_joined_commits_and_writes_nothing(tmp_path):
    ckpt, stats = tmp_path / "ckpt", tmp_path / "stats"
    settings = Settings(job="partition", num_replicas=2, min_replicas=1)  # heartbeat timeout 3 s
    coordinator = CoordinatorThread(settings, TOKEN)
    coordinator.start()
    server, m = coordinator.server, coordinator.server.membership
    # Every committed step is kept: what the zombie could add to step 10 stays to be seen.
    common = {contract.ENV_CHECKPOINT_URI: str(ckpt), contract.ENV_CHECKPOINT_INTERVAL: "10",
              contract.ENV_CHECKPOINT_KEEP: "1000"}

    def launch(identity: Identity, **env: str):
        return start_launcher(coordinator.url, TOKEN, 2, stats, 100_000, script=SCRIPT, args=("--step-seconds", "0.05"),
                              output=tmp_path / f"r{identity.replica_id}-g{identity.generation}.log",
                              **{contract.ENV_REPLICA_ID: str(identity.replica_id),
                                 contract.ENV_REPLICA_GENERATION: str(identity.generation)}, **common, **env)

    launchers = [launch(FIRST), launch(ZOMBIE, TRANSOM_FAULT="stop:step=10,phase=checkpoint")]
    zombie_launcher, worker = launchers[1], None
    try:
        worker = cut_off(zombie_launcher, coordinator)
        launchers.append(launch(REPLACEMENT))
        wait_until(lambda: coordinator.call(lambda: m.current is not None and REPLACEMENT in m.current.members), 120,
                   "the replacement joined a round")
        step10 = ckpt / "step-000000000010"
        before = files_under(step10)
        assert before and not any("/part-1/" in f for f in before), before  # replica 0's part, not the zombie's
        counted = coordinator.call(lambda: dict(server.refusals.counts))
        steps_before = committed(stats, ZOMBIE)

        # The heal: the zombie's threads carry on where they stopped.
        os.kill(worker, signal.SIGCONT)
        wait_until(lambda: process_state(worker) in ("Z", None), 60, "the zombie's worker to exit")
        zombie_launcher.send_signal(signal.SIGCONT)
        zombie_launcher.wait(timeout=60)
        output = (tmp_path / "r1-g0.log").read_text()

        # Nothing appeared (replica 0, its committer, still waits for part 1), and so no commit.
        assert files_under(step10) - before == set(), "the zombie wrote into the checkpoint after it was replaced"
        assert not (step10 / "manifest.json").exists()
        assert_refused(coordinator, output, counted)
        # No step of its own: whatever it committed, replica 0 committed under the same quorum.
        mine = committed(stats, ZOMBIE)
        assert mine - steps_before <= committed(stats, FIRST), (steps_before, mine)
        assert max(s for s, _ in mine) <= max(s for s, _ in steps_before) + 1
        # The job goes on without it.
        step = coordinator.call(m.replicas.max_step)
        wait_until(lambda: coordinator.call(m.replicas.max_step) >= step + 5, 60, "training to go on")
    finally:
        if worker is not None and process_state(worker) not in ("Z", None):
            os.kill(worker, signal.SIGKILL)
        for p in launchers:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
        kill_all(launchers)
        coordinator.stop()
