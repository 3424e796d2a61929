"""What the coordinator does with signals and verdicts (coordinator/detection.py), without I/O."""

from __future__ import annotations

import pytest

from membership_world import qreq
from transom.coordinator.detection import Detection
from transom.coordinator.membership import Membership, Settings
from transom.coordinator.models import (
    CollectiveCounts,
    Identity,
    LeaveRequest,
    RegisterRequest,
    SignalBatch,
    SignalRow,
)
from transom.detect.step_rows import DetectionSettings, post_interval
from transom.errors import Evicted
from transom.words import FailureKind
from transom_operator import api


def world(settings: DetectionSettings, replicas: int = 3, step: int = 100,
          ranks: int = 1) -> tuple[Membership, Detection]:
    """Replicas registered holding `step` committed steps (rows of earlier steps are possible)."""
    m = Membership(Settings(job="t", num_replicas=replicas))
    for r in range(replicas):
        m.register(RegisterRequest(identity=Identity(replica_id=r, generation=0, attempt=0), store_addr="h:1",
                                   state_endpoints=["http://h"] * ranks, step=step), now=0.0)
    return m, Detection(settings, m)


def fingerprints(d: Detection, step: int, odd_one: int, replicas: int = 3) -> list:
    out = []
    for r in range(replicas):
        row = SignalRow(step=step, rank=0, step_seconds=0.5, fingerprint=7 + (r == odd_one))
        out += d.observe(SignalBatch(identity=Identity(replica_id=r, generation=0, attempt=0), node_rank=0,
                                     rows=[row]), now=1.0)
    return out


def test_replace_fails_the_incarnation_and_lists_the_verdict_for_the_operator():
    m, d = world(DetectionSettings())
    (v,) = fingerprints(d, 49, odd_one=2)
    assert (v.replica, v.kind) == (2, "sdc")
    assert m.replicas[2].state == "failed" and "SilentDataCorruption" in m.replicas[2].last_failure
    (entry,) = d.status_verdicts()
    assert entry["replica"] == 2 and entry["generation"] == 0 and entry["blame"] == "Node" and entry["nodeRank"] == 0
    assert d.verdicts_total["sdc"] == 1 and any(e.kind == "verdict" for e in m.events)


def test_report_only_records_an_event():
    m, d = world(DetectionSettings(action="Report"))
    assert len(fingerprints(d, 49, odd_one=1)) == 1
    assert m.replicas[1].state == "healthy" and d.status_verdicts() == []
    assert any(e.kind == "verdict" for e in m.events)


def test_a_replica_speaks_only_for_itself_and_only_while_live():
    m, d = world(DetectionSettings())
    # Rows carry no replica id: they count for the poster, so replica 0 cannot frame replica 1.
    batch = SignalBatch(identity=Identity(replica_id=0, generation=0, attempt=0),
                        rows=[SignalRow(step=3, rank=0, step_seconds=1e6)])
    d.observe(batch, now=1.0)
    for r in (1, 2):
        d.observe(SignalBatch(identity=Identity(replica_id=r, generation=0, attempt=0),
                              rows=[SignalRow(step=3, rank=0, step_seconds=0.5)]), now=1.0)
    assert [v["replica"] for v in d.status_verdicts()] == [0]
    with pytest.raises(Evicted):  # the failed incarnation's later rows are refused
        d.observe(batch, now=2.0)


def test_the_last_rows_of_a_replica_that_left_still_count_and_a_failed_ones_do_not():
    # A launcher posts its workers' last rows after they left the job (it reads them after
    # the workers exit): judged. Those of an incarnation declared failed are refused.
    m, d = world(DetectionSettings(), replicas=2)
    for r in (0, 1):
        m.leave(LeaveRequest(identity=Identity(replica_id=r, generation=0, attempt=0), step=100), 1.0)
    same = [SignalRow(step=0, rank=0, step_seconds=0.5, input_digest=12345)]
    for r in (0, 1):
        d.observe(SignalBatch(identity=Identity(replica_id=r, generation=0, attempt=0), rows=same), now=2.0)
    finding = d.duplicate_data()
    assert finding is not None and finding.replicas == [0, 1] and finding.step == 0
    m2, d2 = world(DetectionSettings(), replicas=2)
    m2.fail(m2.replicas[1], 1.0, "reported", "reported")
    with pytest.raises(Evicted):
        d2.observe(SignalBatch(identity=Identity(replica_id=1, generation=0, attempt=0), rows=same), now=2.0)


def _rows_of(d: Detection, replica: int, attempt: int, rows: list[SignalRow]) -> list:
    return d.observe(SignalBatch(identity=Identity(replica_id=replica, generation=0, attempt=attempt), rows=rows),
                     now=1.0)


def _restart(m: Membership, replica: int, attempt: int, step: int = 100) -> None:
    m.register(RegisterRequest(identity=Identity(replica_id=replica, generation=0, attempt=attempt),
                               store_addr="h:1", state_endpoints=["http://h"], step=step), now=2.0)


@pytest.mark.parametrize("new_one_posts", [True, False])
def test_rows_an_old_incarnation_posted_ahead_never_condemn_its_successor(new_one_posts):
    # Replica 0's corrupt copy posts the fingerprints of steps 49 and 59 before the others'
    # arrive: step 49 condemns it; its successor, catching up, never trained step 59, and
    # the old row of it is no verdict against the successor (a CI run once replaced it twice).
    m, d = world(DetectionSettings())
    _rows_of(d, 0, 0, [SignalRow(step=s, rank=0, step_seconds=0.5, fingerprint=8) for s in (49, 59)])
    found = [v for r in (1, 2) for v in _rows_of(d, r, 0, [SignalRow(step=49, rank=0, step_seconds=0.5,
                                                                      fingerprint=7)])]
    assert [(v.replica, v.first_step) for v in found] == [(0, 49)] and m.replicas[0].state == "failed"
    _restart(m, 0, attempt=1)
    if new_one_posts:
        _rows_of(d, 0, 1, [SignalRow(step=60, rank=0, step_seconds=0.5, recovery=True)])
    for r in (1, 2):
        assert _rows_of(d, r, 0, [SignalRow(step=59, rank=0, step_seconds=0.5, fingerprint=7)]) == []
    assert m.replicas[0].state == "healthy" and d.verdicts_total["sdc"] == 1


def test_a_verdict_on_a_crashed_incarnations_rows_leaves_its_successor_alone():
    # The rows of an incarnation that failed by other means (its process died) may still
    # make a verdict: an event about it, but its successor is not failed for it.
    m, d = world(DetectionSettings())
    _rows_of(d, 0, 0, [SignalRow(step=59, rank=0, step_seconds=0.5, fingerprint=8)])
    m.fail(m.replicas[0], 1.5, "its process died", FailureKind.REPORTED)
    _restart(m, 0, attempt=1)
    found = [v for r in (1, 2) for v in _rows_of(d, r, 0, [SignalRow(step=59, rank=0, step_seconds=0.5,
                                                                      fingerprint=7)])]
    assert [(v.replica, v.kind) for v in found] == [(0, "sdc")]
    assert m.replicas[0].identity.attempt == 1 and m.replicas[0].state == "healthy"


def test_a_source_whose_rows_wait_for_its_next_post_still_vouches_for_its_snapshot():
    # Steps of 5 ms, rows posted once a second: the source's newest posted row is 200 steps
    # behind when the joiner's first rows (from step 385, its first round) come. The source
    # is not taken for a rank that stopped reporting: step 385 waits for its row, which
    # carries the fingerprint the joiner checks its snapshot against. With a fixed 64-step
    # lag, step 385 was judged on the joiner's row alone, the source's came "too late", and
    # the joiner waited 65 s for a record that never came (two CI runs).
    m, d = world(DetectionSettings(), replicas=2, step=400)
    for r in (0, 1):  # both train; replica 1 dies after step 44 and its next incarnation joins at 385
        _rows_of(d, r, 0, [SignalRow(step=s, rank=0, step_seconds=0.005) for s in range(30, 45)])
    m.fail(m.replicas[1], 1.0, "killed", FailureKind.REPORTED)
    _restart(m, 1, attempt=1, step=400)
    _rows_of(d, 0, 0, [SignalRow(step=s, rank=0, step_seconds=0.005) for s in range(45, 185)])
    _rows_of(d, 1, 1, [SignalRow(step=s, rank=0, step_seconds=0.005, recovery=True) for s in range(385, 390)])
    assert d.fingerprint(386, 0).state == "unknown"  # not judged yet: the source's row is on its way
    _rows_of(d, 0, 0, [SignalRow(step=s, rank=0, step_seconds=0.005, fingerprint=77 if s == 385 else None)
                       for s in range(185, 390)])
    record = d.fingerprint(386, 0)
    assert (record.state, record.value) == ("single", 77) and d.rows_refused == 0
    assert d.detectors.lag_steps == 400  # two 1 s intervals of 5 ms steps


def test_disabled_detection_judges_nothing():
    m, d = world(DetectionSettings(enabled=False))
    assert fingerprints(d, 49, odd_one=2) == [] and m.replicas[2].state == "healthy"


def test_launchers_are_paced_so_that_many_post_no_more_often_in_all():
    assert post_interval(1) == post_interval(1000) == 1.0  # a small job: a verdict within seconds
    assert post_interval(12_500) == 12.5  # 100,000 GPUs, 8 per node: 1,000 posts a second in all
    assert post_interval(10**6) == 30.0  # bounded: a verdict is never minutes late
    m, d = world(DetectionSettings(), replicas=3)
    for node in range(2000):  # replica 0 with 2,000 nodes
        d.observe(SignalBatch(identity=Identity(replica_id=0, generation=0, attempt=0), node_rank=node, rows=[]),
                  now=1.0)
    assert d.post_interval(1.0) == 2.0
    # A launcher not heard from for two of the longest intervals no longer counts.
    d.observe(SignalBatch(identity=Identity(replica_id=1, generation=0, attempt=0), node_rank=0, rows=[]), now=62.0)
    assert d.post_interval(62.0) == 1.0


def _nan_rows(d: Detection, replica: int, steps: range) -> list:
    rows = [SignalRow(step=step, rank=0, step_seconds=0.5, loss=float("nan"), finite=False) for step in steps]
    return d.observe(SignalBatch(identity=Identity(replica_id=replica, generation=0, attempt=0), rows=rows), now=1.0)


def test_a_row_past_what_its_replica_can_have_committed_is_refused_and_blinds_no_one():
    # One row at step 2^62 used to move the judged-up-to mark there: every later row was
    # "late" and a replica training on NaN was never flagged.
    m, d = world(DetectionSettings(), step=10)
    far = SignalBatch(identity=Identity(replica_id=2, generation=0, attempt=0),
                      rows=[SignalRow(step=2**62, rank=0, step_seconds=0.5)])
    assert d.observe(far, now=1.0) == [] and d.rows_refused == 1
    for r in (0, 2):  # the others' normal rows of steps 0..9
        for step in range(10):
            d.observe(SignalBatch(identity=Identity(replica_id=r, generation=0, attempt=0),
                                  rows=[SignalRow(step=step, rank=0, step_seconds=0.5, loss=1.0)]), now=1.0)
    verdicts = _nan_rows(d, 1, range(10))
    assert [(v.replica, v.kind) for v in verdicts] == [(1, "nan")]


def test_rows_of_ranks_a_replica_does_not_have_are_refused():
    # Rank ids up to 2^20 grew the detectors' per-rank state with every post.
    m, d = world(DetectionSettings(), ranks=2)
    rows = [SignalRow(step=5, rank=k, step_seconds=0.5) for k in range(4096)]
    d.observe(SignalBatch(identity=Identity(replica_id=0, generation=0, attempt=0), rows=rows), now=1.0)
    assert d.rows_refused == 4094
    assert {k for (r, k) in d.detectors._ranks_seen if r == 0} == {0, 1}


# --- a hang's culprit (detect/hangs.py) ------------------------------------------------------------
def _counts(rank: int, group: tuple[int, int], ftar: tuple[int, int]) -> CollectiveCounts:
    return CollectiveCounts(rank=rank, group_id=0, ftar_entered=ftar[0], ftar_completed=ftar[1],
                            group_entered=group[0], group_completed=group[1])


def _hang_world() -> tuple[Membership, Detection]:
    """Three replicas of two ranks in quorum 0; rank 1 of replica 2 never entered all-reduce
    41, and its rank 0 waits for it in the vote; replica 1's rank 1 waits in the all-reduce.
    All of it posted at t=1 (none of them moves after)."""
    m, d = world(DetectionSettings(hang_timeout_s=10), ranks=2)
    for r in range(3):
        m.request_quorum(qreq(r, step=100), 0.0)
    assert m.current is not None and m.current.member_ids() == [0, 1, 2]
    post(d, 1, [], now=1.0, collectives=[_counts(0, (31, 30), (41, 41)), _counts(1, (30, 30), (41, 40))])
    post(d, 2, [], now=1.0, collectives=[_counts(0, (31, 30), (41, 41)), _counts(1, (30, 30), (40, 40))])
    return m, d


def post(d: Detection, replica: int, rows: list[SignalRow], now: float, stacks: str | None = None,
         collectives: list[CollectiveCounts] | None = None) -> list:
    return d.observe(SignalBatch(identity=Identity(replica_id=replica, generation=0, attempt=0), rows=rows,
                                 stacks=stacks, collectives=collectives or []), now=now)


def _judge_step_100(d: Detection, now: float) -> list:
    """The other replicas' rows of step 100 complete it (the hang's row is of step 100)."""
    out = []
    for r in (1, 2):
        out += post(d, r, [SignalRow(step=100, rank=k, step_seconds=0.5) for k in (0, 1)], now=now)
    return out


def test_a_waiting_replicas_hang_report_blames_the_rank_it_waits_for():
    """Replica 0's watchdog fired on its rank 1 (waiting in the all-reduce, in a wait it did not
    see as one). Replica 2's own counts show it behind, and it made no progress the coordinator
    saw for longer than half the hang timeout: the verdict, and the Replace, are replica 2's."""
    m, d = _hang_world()
    # The watchdog's post: its hang row alone (its rank 0 will not report step 100: the step
    # is judged without it).
    found = post(d, 0, [SignalRow(step=100, rank=1, step_seconds=12.0)], now=12.0, stacks="--- rank 1 ---\nin wait",
                 collectives=[_counts(0, (31, 30), (41, 41)), _counts(1, (30, 30), (41, 40))])
    found += _judge_step_100(d, now=12.5)
    (v,) = found
    assert (v.replica, v.rank, v.culprit_replica, v.culprit_rank) == (2, 1, 2, 1)
    assert v.evidence is not None and "rank 1 of replica 2 entered 40 all-reduces of quorum 0" in v.evidence
    assert m.replicas[2].state == "failed" and m.replicas[0].state == "healthy"
    (entry,) = d.status_verdicts()
    assert entry["replica"] == 2 and entry["rank"] == 1 and "stacks of replica 0:" in entry["message"]
    api.Verdict.model_validate(entry)  # what the CRD's status takes


def test_a_lying_replicas_hang_report_blames_no_one_else():
    """Replica 0 claims its rank 1 entered 1,000 all-reduces and waits: replicas 1 and 2 are
    level (their own counts), so the verdict stays replica 0's, as the watchdog had it."""
    m, d = _hang_world()
    post(d, 2, [], now=1.0, collectives=[_counts(0, (31, 31), (41, 41)), _counts(1, (31, 31), (41, 41))])
    post(d, 1, [], now=1.0, collectives=[_counts(0, (31, 31), (41, 41)), _counts(1, (31, 31), (41, 41))])
    rows = [SignalRow(step=100, rank=0, step_seconds=0.5), SignalRow(step=100, rank=1, step_seconds=12.0)]
    found = post(d, 0, rows, now=12.0, stacks="x",
                 collectives=[_counts(1, (31, 31), (1000, 999))])
    found += _judge_step_100(d, now=12.5)
    (v,) = found
    assert (v.replica, v.rank, v.culprit_replica, v.culprit_rank, v.evidence) == (0, 1, 0, 1, None)
    assert m.replicas[2].state == m.replicas[1].state == "healthy" and m.replicas[0].state == "failed"
    (entry,) = d.status_verdicts()
    assert entry["replica"] == 0 and "rank" not in entry  # the watchdog's word: no evidence names a rank
