"""Every timeout and interval default of Transom, in one place.

A job runs in one of two settings, and their defaults differ on purpose:

- `LOCAL`: `transom run` on one machine, and a script or coordinator started by hand.
  Everything shares a loopback; a stall means a fault, and a test or a demo should see it
  in seconds.
- `CLUSTER`: a TrainingJob on Kubernetes (the CRD's defaults, which the operator passes to
  the pods and the coordinator). Networks hiccup, garbage collectors pause, a step of a
  large model or its first NCCL call can take long: a healthy replica must not be dropped
  for that, so the timeouts are longer.

The CLI, `FTConfig`, `CheckpointConfig`, `LaunchConfig`, `RunConfig`, the coordinator's
`Settings` and the CRD read their defaults from here (every wait a user can set; the short
polls and grace periods that no flag or spec field sets stay beside the code they pace);
`table()` is docs/defaults.md (`make generate`, checked by a test).
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True)
class Timeouts:
    """Seconds; what each one bounds is in DESCRIPTIONS."""

    collective_timeout_s: float
    heartbeat_timeout_s: float
    quorum_timeout_s: float
    recovery_timeout_s: float
    failed_grace_s: float
    round_timeout_s: float
    startup_wait_s: float
    status_interval_s: float


DESCRIPTIONS = {
    "collective_timeout_s": "A cross-replica collective that takes longer fails the step (a hung peer costs this).",
    "heartbeat_timeout_s": "A replica without a heartbeat for this long is declared failed by the coordinator.",
    "quorum_timeout_s": "How long a step waits for its quorum (training paused below minReplicas) before raising.",
    "recovery_timeout_s": "How long a joining replica waits for a peer's state.",
    "failed_grace_s": "How long a round with a reported failure waits for members that did not ask again.",
    "round_timeout_s": "A quorum member that does not ask for its next quorum this long after another did is hung.",
    "startup_wait_s": "How long the coordinator waits for the first replicas before forming a smaller quorum.",
    "status_interval_s": "Seconds between the coordinator's writes of status.training.",
}


LOCAL = Timeouts(collective_timeout_s=10.0, heartbeat_timeout_s=3.0, quorum_timeout_s=900.0,
                 recovery_timeout_s=120.0, failed_grace_s=1.0, round_timeout_s=120.0, startup_wait_s=60.0,
                 status_interval_s=5.0)
CLUSTER = Timeouts(collective_timeout_s=60.0, heartbeat_timeout_s=30.0, quorum_timeout_s=900.0,
                   recovery_timeout_s=120.0, failed_grace_s=1.0, round_timeout_s=120.0, startup_wait_s=60.0,
                   status_interval_s=5.0)


# OOM kills of one replica before its job fails rather than restart it again: in place (the
# launcher counts its workers' kills and exits contract.EXIT_OOM_KILLED at this many), and
# across replacements (the operator counts incarnations that ended OOMKilled within
# spec.faultTolerance.restartWindowSeconds). The same script at the same memory limit runs
# out of memory the same way: restarting it forever is a crash loop.
OOM_KILL_LIMIT = 3
# Pre-flight checks (transom.check, spec.preflight): the budget of all the checks of one
# pre-flight together (a check still running when it is spent fails as timed out), and how
# often a hot spare that waits is checked again.
PREFLIGHT_TIMEOUT_S = 30.0
PREFLIGHT_SPARE_INTERVAL_S = 300.0
# Fencing (ft/fencing.py), the same in both settings. A replica asks the coordinator before
# each checkpoint object it writes or deletes; one question waits at most this long, and an
# answer that took longer to come back is not trusted (the process may have been stopped
# while it travelled): it is asked again later.
FENCE_TIMEOUT_S = 5.0
# Until the coordinator says how long a confirmation vouches for a replica's state server
# (its heartbeat timeout), the shortest heartbeat timeout of the two settings: a shorter
# lease only costs more questions, never a wrong answer.
FENCE_LEASE_S = LOCAL.heartbeat_timeout_s

# The coordinator's own timers, the same in both settings (coordinator/ and detect/).
# A failed round waits for an absent member at least this many of the job's recent rounds:
# a member still computing its step meets the failed exchange only at the step's end, and
# on a loaded machine that can be well past `failed_grace_s`.
FAILED_GRACE_ROUNDS = 3
# A quiet round answers for the steps of about this many seconds after it (coordinator/lease.py):
# what a quiet job cannot hear meanwhile (a joiner, a verdict, a finish) waits about this long.
# `transom coordinator --quorum-lease 0` turns leases off: every step asks.
QUORUM_LEASE_S = 1.0
COORDINATOR_TICK_S = 0.05  # how often heartbeat expiry and round grace periods are checked
MAX_STATE_WAIT_S = 60.0  # the longest a replica-state long-poll (GET /v1/replicas/{id}) is held
KUBE_REQUEST_TIMEOUT_S = 10.0  # every request of the coordinator to the API server
KUBE_REVIEW_TTL_S = 120.0  # a TokenReview's answer is kept this long, as the API server's own webhook cache
KUBE_POD_TTL_S = 30.0  # a pod's labels are kept this long (kube_identity.py)
KUBE_REFRESH_GAP_S = 1.0  # a pod is read again at most this often before a refusal
# TokenReviews for bearer strings the coordinator does not know (coordinator/review_gate.py):
# a token the API server refused is refused again without asking for KUBE_FAILED_REVIEW_TTL_S;
# each caller (peer address) may send KUBE_REVIEW_BURST reviews at once, then KUBE_REVIEWS_PER_S
# a second (an honest pod sends one per token the kubelet gives it, about one an hour).
KUBE_FAILED_REVIEW_TTL_S = 10.0
KUBE_REVIEW_BURST = 8
KUBE_REVIEWS_PER_S = 0.5
QUORUM_WAKE_S = 1.0  # a held quorum long-poll checks at least this often whether it was evicted
# How often a launcher posts its pod's signal rows: once a second, or less often when many
# post (detect/step_rows.py `post_interval`), never less often than MAX_FORWARD_INTERVAL_S.
FORWARD_INTERVAL_S = 1.0
MAX_FORWARD_INTERVAL_S = 30.0
# A coordinator client's call waits at most this long for its answer: a quick question
# (heartbeat, signals, a replica's state), a report, and anything else (a quorum long-poll
# passes its own).
CLIENT_QUICK_TIMEOUT_S = 2.0
CLIENT_REPORT_TIMEOUT_S = 5.0
CLIENT_TIMEOUT_S = 30.0

# The checkpoint engine's waits (checkpoint/engine.py CheckpointConfig), the same in both
# settings. Part 0's writer waits for the other parts CHECKPOINT_COMMIT_TIMEOUT_S, or 3x the
# time its own part took if longer (parts are balanced by size: a writer far slower is gone).
CHECKPOINT_COMMIT_TIMEOUT_S = 60.0
CHECKPOINT_SNAPSHOT_TIMEOUT_S = 300.0  # the host copy of a snapshot, before the next optimizer step
CHECKPOINT_CLOSE_TIMEOUT_S = 300.0  # close() waits this long for the last checkpoint to persist
CHECKPOINT_RESTORE_TIMEOUT_S = 300.0  # a restore waits this long for storage that is away
CHECKPOINT_RETRY_FIRST_S = 0.5  # a failed storage call is tried again after this, doubling
# ... up to this between two tries: storage that comes back is written to again within it
# (30 s kept the newest checkpoint 150 steps old after a 10 s outage in the chaos run; 5 s,
# 32 steps of 0.27 s after a 15 s one, over its interval of 20). A try is one request with a
# 3 s connect timeout (checkpoint/storage.py), so a try a second costs the storage nothing.
CHECKPOINT_RETRY_MAX_S = 1.0

# The launcher's (launch/config.py LaunchConfig) and `transom run`'s (RunConfig) waits.
RESTART_BACKOFF_S = 0.5  # before the second in-place restart of the workers, doubling
TERM_GRACE_S = 10.0  # workers sent SIGTERM get this long before SIGKILL
RENDEZVOUS_TIMEOUT_S = 300.0  # node k > 0 of a replica waits this long for node 0's address
RUN_TIMEOUT_S = 3600.0  # `transom run --timeout`: the whole run


def heartbeat_interval_s(timeout_s: float) -> float:
    """One beat a second, or three per timeout when the timeout is shorter than 3 s."""
    return min(1.0, timeout_s / 3)


def table() -> str:
    """docs/defaults.md: the two settings side by side."""
    rows = ["# Timeout and interval defaults", "",
            "Generated from `launcher/transom/defaults.py` by `make generate`; do not edit.", "",
            "| setting | local (`transom run`, by hand) | cluster (TrainingJob) | what it bounds |",
            "|---|---|---|---|"]
    for f in fields(Timeouts):
        local, cluster = getattr(LOCAL, f.name), getattr(CLUSTER, f.name)
        rows.append(f"| `{f.name}` | {local:g} | {cluster:g} | {DESCRIPTIONS[f.name]} |")
    rows += ["", "The heartbeat interval follows the timeout: `min(1, timeout / 3)` seconds.", "",
             f"Fencing (the same in both): a replica's question to the coordinator before each checkpoint "
             f"object it writes or deletes waits at most {FENCE_TIMEOUT_S:g} s; a state server that has not been "
             f"vouched for within the heartbeat timeout ({FENCE_LEASE_S:g} s until the coordinator said) asks "
             f"before it serves.", ""]
    return "\n".join(rows)


if __name__ == "__main__":
    import sys

    out = table()
    if sys.argv[1:2] == ["--write"]:
        with open(sys.argv[2], "w") as f:
            f.write(out)
    else:
        print(out, end="")
