"""Before a coordinator's first round no round bounds what a replica registers with: no step
is believed on one replica's word (coordinator/claims.py `believed_step`, `unsupported`,
`supported`). Pure Membership calls with explicit times."""

from __future__ import annotations

from membership_world import ident, make, qreq, register
from transom.coordinator.models import CheckpointReport


def test_a_lone_registration_past_the_others_is_failed_by_the_first_round_not_followed():
    """Before a coordinator's first round nothing bounds a registration: replica 0 registered
    at 2^62 - 1 was the first round's newest state, and the honest replicas at step 40 were told
    to recover from it. Now the first round fails it (it restarts from the checkpoint)."""
    m = make(3, heartbeat_timeout_s=3600.0)
    for rid, step in ((0, 2**62 - 1), (1, 40), (2, 40)):
        register(m, rid, step=step)
    m.request_quorum(qreq(0, 2**62 - 1), 1.0)
    m.request_quorum(qreq(1, 40), 1.0)
    d = m.request_quorum(qreq(2, 40), 1.0)
    assert d is not None and d.member_ids() == [1, 2] and d.max_step == 40 and d.recovering == ()
    assert m.replicas[0].state == "failed" and m.failures_total["unsupported"] == 1
    assert "no other replica holds more than 40 committed steps" in m.replicas[0].last_failure


def test_honest_replicas_a_step_apart_after_a_coordinator_restart_all_join_its_first_round():
    # One had the old coordinator's last answer and trained its step; the other's was lost.
    m = make(2, heartbeat_timeout_s=3600.0)
    register(m, 0, step=41)
    register(m, 1, step=40)
    m.request_quorum(qreq(0, 41), 1.0)
    d = m.request_quorum(qreq(1, 40), 1.0)
    assert d is not None and d.member_ids() == [0, 1] and d.max_step == 41 and d.recovering == (1,)
    assert m.failures_total.get("unsupported", 0) == 0


def test_a_checkpoint_report_no_second_replica_supports_is_held_not_counted():
    # Replica 0 alone at 2^62 - 1 before the first round: its report was status's
    # lastCheckpoint (the checkpoint a resume looks for) on its word alone.
    m = make(3, heartbeat_timeout_s=3600.0)
    register(m, 0, step=2**62 - 1)
    register(m, 1, step=40)
    m.record_checkpoint(CheckpointReport(identity=ident(0), step=2**62 - 1, uri="s3://b/x"), 1.0, 1.0)
    assert m.last_checkpoint is None
    m.record_checkpoint(CheckpointReport(identity=ident(1), step=40, uri="s3://b/x"), 1.0, 1.0)
    assert m.last_checkpoint is not None and m.last_checkpoint[0] == 40
    register(m, 2, step=40)
    assert m.last_checkpoint[0] == 40


def test_an_honest_report_made_before_a_second_replica_registered_counts_once_one_did():
    m = make(2, heartbeat_timeout_s=3600.0)
    register(m, 0, step=100)  # re-registered with a restarted coordinator, its persist just done
    assert m.record_checkpoint(CheckpointReport(identity=ident(0), step=100, uri="s3://b/x"), 1.0, 1.0)
    assert m.last_checkpoint is None and m.held_checkpoints
    register(m, 1, step=100)
    assert m.last_checkpoint is not None and m.last_checkpoint[0] == 100 and not m.held_checkpoints
