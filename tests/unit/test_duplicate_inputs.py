"""Replicas that train on the same data: the comparison of input digests (detect/duplicates.py),
what the coordinator does with it (coordinator/detection.py), and how a digest travels in a row."""

from __future__ import annotations

import io

import pytest
from pydantic import ValidationError

from transom.coordinator.detection import Detection
from transom.coordinator.membership import Membership, Settings
from transom.coordinator.models import Identity, RegisterRequest, SignalBatch, SignalRow
from transom.detect.duplicates import MAX_PARTNERS, MAX_STEPS, DuplicateInputs, message
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
    for step in (1, 2, 50):  # the same bug at every later step: no second finding, the same one grows
        assert not d.observe(step, 0, 0, 100 + step) and not d.observe(step, 1, 0, 100 + step)
    assert (d.finding.step, d.finding.last_step, d.finding.replicas) == (0, 50, (0, 1))
    assert d.finding.message.startswith("replicas 0 and 1 trained on identical inputs at steps 0 to 50: ")
    assert d.finding.summary() == {"step": 0, "replicas": [0, 1], "message": d.finding.message}


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
    assert sorted(d._digests[0]) == due[-MAX_STEPS:]  # bounded memory
    d.observe(due[-MAX_STEPS], 1, 0, due[0])  # replica 1's own memory has room: kept, compared ...
    assert not d.observe(due[0], 0, 0, due[0])  # ... but replica 0 forgot that step: not taken again
    assert sorted(d._digests[0]) == due[-MAX_STEPS:] and d.finding is None
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


# --- findings one replica cannot silence (issue 43) -----------------------------------------------
HUGE = (2**62 // INPUT_DIGEST_INTERVAL) * INPUT_DIGEST_INTERVAL  # the largest due step a row may name


def test_a_third_replicas_duplicate_among_its_own_ranks_does_not_hide_two_replicas_on_one_input():
    d = DuplicateInputs()
    d.observe(0, 2, 0, 5)
    assert d.observe(0, 2, 1, 5)  # replica 2's own ranks on one input: found, the lesser kind
    assert d.finding.replicas == (2,)
    d.observe(0, 0, 0, 9)
    assert d.observe(0, 1, 0, 9)  # the real duplicate, between replicas 0 and 1
    assert (d.finding.step, d.finding.replicas) == (0, (0, 1))
    assert d.finding.message.startswith(f"replicas 0 and 1 trained on identical inputs at step 0: {ACROSS_FIX}")


def test_tensor_parallel_ranks_sharing_their_input_do_not_hide_a_duplicate_across_replicas():
    d = DuplicateInputs()
    for step in (0, 1, 2, 50):
        for replica in range(4):
            # Ranks 0 and 1 of a replica are tensor-parallel peers: one input, honestly. Replicas 2
            # and 3 are seeded alike, so they train on the same inputs.
            digest = 1000 * step + (2 if replica == 3 else replica)
            d.observe(step, replica, 0, digest)
            d.observe(step, replica, 1, digest)
    assert d.finding.replicas == (2, 3)
    assert (d.finding.step, d.finding.last_step) == (0, 50)
    assert d.finding.message.startswith("replicas 2 and 3 trained on identical inputs at steps 0 to 50")


def test_eight_huge_steps_from_one_replica_evict_only_its_own_digests():
    d = DuplicateInputs()
    for k in range(MAX_STEPS):  # replica 2 fills what was the job's whole memory
        d.observe(HUGE - k * INPUT_DIGEST_INTERVAL, 2, 0, 2**62 + k)
    d.observe(100, 0, 0, 77)
    assert d.observe(100, 1, 0, 77)
    assert d.finding.replicas == (0, 1)
    flood = 100 * MAX_STEPS
    for k in range(flood):  # a flood of its own steps and ranks keeps its memory as small as any replica's
        for rank in range(4):
            d.observe(HUGE - (flood - k) * INPUT_DIGEST_INTERVAL, 2, rank, k)
    assert d.kept(2) <= MAX_STEPS * 4 and d.kept(0) == 1
    assert d.finding.replicas == (0, 1)


def test_a_liar_that_copies_a_digest_makes_its_own_pair_and_names_no_honest_pair_falsely():
    d = DuplicateInputs()
    d.observe(0, 0, 0, 1)
    d.observe(0, 1, 0, 2)
    d.observe(0, 2, 0, 1)  # replica 2 copies replica 0's digest
    d.observe(0, 2, 1, 2)  # ... and replica 1's
    assert d.pairs() == {(0, 2): (0, 0), (1, 2): (0, 0)}  # never (0, 1): they trained on distinct inputs


def test_findings_of_many_replicas_stay_bounded_and_name_every_replica():
    d = DuplicateInputs()
    for replica in range(100):  # every replica seeded alike
        d.observe(0, replica, 0, 42)
    assert d.finding.replicas == tuple(range(100))
    assert len(d.pairs()) <= 100 * MAX_PARTNERS
    assert len(d.finding.message) < 1024


def test_the_coordinator_shows_the_pair_of_replicas_after_a_replicas_own_ranks_and_logs_it_again():
    m, d = world(replicas=3)
    post(d, 2, row(0, 0, 5), row(0, 1, 5))  # replica 2's own ranks: the lesser kind, shown while alone
    assert d.duplicate_data().replicas == [2] and d.take_duplicate().replicas == [2]
    post(d, 0, row(0, 0, 9), row(0, 1, 10))
    post(d, 1, row(0, 0, 9), row(0, 1, 11))
    found = d.duplicate_data()
    assert (found.step, found.replicas) == (0, [0, 1]) and found.message.startswith("replicas 0 and 1 trained")
    assert d.take_duplicate() == found and d.take_duplicate() is None  # logged again: it names others now
    assert [e.message.split(" trained")[0] for e in m.events if e.kind == "duplicate_data"] == \
        ["ranks 0 and 1 of replica 2", "replicas 0 and 1"]


def test_a_replica_cannot_flood_the_coordinators_memory_with_steps_it_cannot_have():
    m, d = world(replicas=3, ranks=2)
    m.try_decide(2.0)  # a round answers every replica: steps past 11 are more than any can have
    post(d, 2, *(row(s * INPUT_DIGEST_INTERVAL, 0, s) for s in range(1, 4000)))
    assert d.rows_refused >= 3990 and d.duplicates.kept(2) <= MAX_STEPS
