"""Replicas that train on the same data: the comparison of input digests (detect/duplicates.py),
what the coordinator does with it (coordinator/detection.py), and how a digest travels in a row."""

from __future__ import annotations

import io

import pytest
from pydantic import ValidationError

from transom.coordinator.detection import Detection
from transom.coordinator.membership import Membership, Settings
from transom.coordinator.models import Identity, RegisterRequest, SignalBatch, SignalRow
from transom.detect.duplicates import MAX_STEPS, DuplicateInputs, message
from transom.detect.step_rows import (
    INPUT_DIGEST_INTERVAL,
    OPTIONAL_COLUMNS,
    TRACE_COLUMNS,
    DetectionSettings,
    Signal,
    TraceParser,
    input_digest_due,
    write_trace,
)

ACROSS_FIX = ("seed or shard the data by the data-parallel rank across replicas (trainer.data_rank / "
              "trainer.data_world_size, or trainer.generator(micro_step)), not by ctx.rank alone")


def test_rank_k_of_two_replicas_on_one_input_is_the_jobs_finding_made_once():
    d = DuplicateInputs()
    assert not d.observe(0, replica=0, rank=0, digest=7) and d.finding is None
    assert d.observe(0, replica=1, rank=0, digest=7)
    assert (d.finding.step, d.finding.replicas, d.finding.ranks) == (0, (0, 1), (0,))
    assert d.finding.message.startswith(f"replicas 0 and 1 trained on identical inputs at step 0: {ACROSS_FIX}. "
                                        "Nothing is restarted")
    first = d.finding
    for step in (1, 2, 50):  # the same bug at every later step: no second finding
        assert not d.observe(step, 0, 0, 100 + step) and not d.observe(step, 1, 0, 100 + step)
    assert d.finding == first
    assert d.finding.summary() == {"step": 0, "replicas": [0, 1], "message": first.message}


def test_distinct_inputs_make_no_finding_not_even_one_step_apart():
    d = DuplicateInputs()
    for step in (0, 1, 2, 50, 100):
        for replica in range(3):
            for rank in range(2):
                # Replica r's batch of step s is replica r+1's of step s-1 (a shifted stream):
                # distinct at every step, which is all that is compared.
                assert not d.observe(step, replica, rank, hash((step + replica, rank)))
    assert d.finding is None


def test_two_ranks_of_one_replica_on_one_input_are_a_sampler_bug_inside_it():
    d = DuplicateInputs()
    d.observe(1, 3, 0, 5)
    assert d.observe(1, 3, 1, 5)
    assert (d.finding.replicas, d.finding.ranks) == ((3,), (0, 1))
    assert d.finding.message.startswith("ranks 0 and 1 of replica 3 trained on identical inputs at step 1: seed or "
                                        "shard the data by the data-parallel rank")
    assert "tensor-parallel peers do share their inputs" in d.finding.message


def test_ranks_that_report_the_same_input_later_join_the_finding():
    d = DuplicateInputs()
    d.observe(0, 0, 0, 9)
    assert d.observe(0, 2, 0, 9)
    assert not d.observe(0, 1, 0, 9)  # joins, is not a finding of its own
    assert d.finding.replicas == (0, 1, 2) and "replicas 0, 1 and 2 trained" in d.finding.message


def test_a_rank_that_reports_a_step_again_is_not_its_own_duplicate():
    d = DuplicateInputs()
    d.observe(50, 0, 0, 11)  # a restarted incarnation trains step 50 again, on its own batch again
    assert not d.observe(50, 0, 0, 11) and d.finding is None


def test_only_due_steps_are_compared_and_the_oldest_are_forgotten():
    assert [s for s in range(120) if input_digest_due(s)] == [0, 1, 2, 50, 100]
    d = DuplicateInputs()
    assert not d.observe(3, 0, 0, 1) and not d.observe(3, 1, 0, 1)  # not due: a liar's choice of step
    due = [s * INPUT_DIGEST_INTERVAL for s in range(1, 3 * MAX_STEPS)]
    for step in due:
        d.observe(step, 0, 0, step)
    assert sorted(d._steps) == due[-MAX_STEPS:]  # bounded memory
    assert not d.observe(due[0], 1, 0, due[0])  # forgotten: not compared, not remembered
    assert sorted(d._steps) == due[-MAX_STEPS:] and d.finding is None
    assert d.observe(due[-1], 1, 0, due[-1])


def test_a_message_names_a_bounded_number_of_replicas():
    text = message(4, range(100), [0])
    assert text.startswith("replicas 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15 and 84 more trained")
    assert len(message(4, range(4096), range(1024))) < 1024  # the CRD's bound


# --- in the coordinator ----------------------------------------------------------------------------
def world(settings: DetectionSettings = DetectionSettings(), replicas: int = 2, ranks: int = 2):
    m = Membership(Settings(job="t", num_replicas=replicas))
    for r in range(replicas):
        m.register(RegisterRequest(identity=Identity(replica_id=r, generation=0, attempt=0), store_addr="h:1",
                                   state_endpoints=["http://h"] * ranks, step=10), now=0.0)
    return m, Detection(settings, m)


def post(d: Detection, replica: int, *rows: SignalRow) -> list:
    return d.observe(SignalBatch(identity=Identity(replica_id=replica, generation=0, attempt=0), rows=list(rows)),
                     now=1.0)


def row(step: int, rank: int, digest: int | None) -> SignalRow:
    return SignalRow(step=step, rank=rank, step_seconds=0.5, input_digest=digest)


def test_the_coordinator_makes_an_event_and_a_status_of_it_and_acts_on_no_replica():
    m, d = world(DetectionSettings(action="Replace"))
    assert post(d, 0, row(0, 0, 1), row(0, 1, 2)) == [] and d.duplicate_data() is None
    assert post(d, 1, row(0, 0, 1), row(0, 1, 2)) == []  # no verdict
    found = d.duplicate_data()
    assert (found.step, found.replicas) == (0, [0, 1])
    assert [e.message for e in m.events if e.kind == "duplicate_data"] == [found.message]
    assert d.take_duplicate() == found and d.take_duplicate() is None  # logged once
    assert d.status_verdicts() == [] and all(r.state == "healthy" for r in m.replicas.values())
    post(d, 0, row(1, 0, 3))
    post(d, 1, row(1, 0, 3))
    assert [e.kind for e in m.events].count("duplicate_data") == 1


def test_rows_a_replica_cannot_have_are_not_compared():
    m, d = world(ranks=1)
    post(d, 0, row(0, 0, 1))
    post(d, 1, row(0, 1, 1))  # a rank replica 1 does not have
    assert d.duplicate_data() is None and d.rows_refused == 1


def test_with_detection_disabled_no_input_is_compared():
    m, d = world(DetectionSettings(enabled=False))
    post(d, 0, row(0, 0, 1))
    post(d, 1, row(0, 0, 1))
    assert d.duplicate_data() is None and not any(e.kind == "duplicate_data" for e in m.events)


# --- in a row -------------------------------------------------------------------------------------
def test_a_digest_travels_in_a_row_and_a_bad_one_is_no_row():
    out = io.StringIO(newline="")
    write_trace([Signal(step=0, replica=1, rank=0, step_seconds=0.5, input_digest=-(2**63)),
                 Signal(step=3, replica=1, rank=0, step_seconds=0.5)], out, header=False)
    text = out.getvalue() + "4,1,0,0.5,,,,,,,,,12x\n" + f"5,1,0,0.5,,,,,,,,,{2**63}\n"
    parser = TraceParser((*TRACE_COLUMNS, *OPTIONAL_COLUMNS))
    rows = parser.feed(text.encode())
    assert [(r.step, r.input_digest) for r in rows] == [(0, -(2**63)), (3, None)]
    assert parser.skipped == 2 and "input_digest must be a 64-bit integer" in parser.first_skipped[1]
    with pytest.raises(ValidationError):
        SignalRow(step=0, rank=0, step_seconds=0.5, input_digest=2**63)


def test_a_trace_written_before_input_digests_is_read_as_before():
    header = (b"step,replica,rank,step_seconds,tokens,sum_len_sq,loss,grad_norm,finite,fingerprint,recovery,"
              b"batch_share\n")
    parser = TraceParser()
    (old,) = parser.feed(header + b"4,1,0,0.5,,,1.5,,1,7,0,\n")
    assert (old.step, old.fingerprint, old.input_digest) == (4, 7, None) and parser.skipped == 0
