"""What `transom run`'s summary claims about a run (launch/summary.py), from hand-made step
records and final digests: how far the job got, even when it was stopped before the end,
and whether the replicas ended bit-identical, judged only on the replicas that held the
job's state at the end; the others are named, with why."""

from __future__ import annotations

import json
from pathlib import Path

from transom.launch.summary import summarize


def steps(directory: Path, replica: int, attempt: int, first: int, last: int, recovering_from: int | None = None):
    """Committed records of steps first..last (a record's step is the count after it)."""
    rows = [{"step": s, "committed": True, "quorum_changed": False, "seconds": 0.1, "loss": 1.0,
             "recovering": recovering_from is not None and s >= recovering_from} for s in range(first, last + 1)]
    (directory / f"steps-r{replica}-g0-a{attempt}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def final(directory: Path, replica: int, step: int, digest: str, rank: int = 0):
    (directory / f"final-r{replica}-k{rank}.json").write_text(
        json.dumps({"replica": replica, "rank": rank, "step": step, "digest": digest}))


def test_a_replica_still_catching_up_at_the_end_is_left_out_of_the_comparison_with_why(tmp_path):
    # Replica 2 was killed at step 50, rejoined at 57 and was catching up when the job completed
    # at 60: it wrote no final digest (its weights were not the job's yet). Nothing differed.
    steps(tmp_path, 0, 0, 1, 60)
    steps(tmp_path, 1, 0, 1, 60)
    steps(tmp_path, 2, 0, 1, 50)
    steps(tmp_path, 2, 1, 58, 60, recovering_from=58)
    final(tmp_path, 0, 60, "aa")
    final(tmp_path, 1, 60, "aa")
    s = summarize(tmp_path, 3, {2: 1}, 1.0)
    assert s["replicas_bit_identical"] is True and s["replicas_compared"] == [0, 1]
    assert s["replicas_not_compared"] == [{"replica": 2, "why": "it was still catching up from its peers when the run "
                                                                "ended: its weights were not yet the job's"}]
    assert s["replicas_finished"] == 2 and s["steps_committed"] == 60


def test_with_one_replica_at_the_job_s_state_nothing_is_compared_and_nothing_is_claimed(tmp_path):
    steps(tmp_path, 0, 0, 1, 40)
    steps(tmp_path, 1, 0, 1, 10)
    steps(tmp_path, 1, 1, 0, -1)  # restarted; the job completed before its new incarnation trained
    final(tmp_path, 0, 40, "aa")
    s = summarize(tmp_path, 2, {1: 1}, 1.0)
    assert s["replicas_bit_identical"] is None and s["replicas_compared"] == [0]
    assert s["replicas_not_compared"] == [{"replica": 1, "why": "its restarted incarnation had trained no step when "
                                                                "the run ended"}]


def test_a_run_stopped_before_the_end_says_how_far_it_got_and_compares_nothing(tmp_path):
    # `transom run` got SIGTERM after 66 committed steps: no replica finished.
    steps(tmp_path, 0, 0, 1, 66)
    steps(tmp_path, 1, 0, 1, 65)
    s = summarize(tmp_path, 2, {}, 1.0)
    assert s["steps_committed"] == 66
    assert s["replicas_bit_identical"] is None and s["replicas_compared"] == [] and s["replicas_finished"] == 0
    assert [n["why"] for n in s["replicas_not_compared"]] == [
        "it had not finished the job when the run ended (its last step record: step 66)",
        "it had not finished the job when the run ended (its last step record: step 65)"]


def test_replicas_that_finished_with_other_bytes_or_steps_differ(tmp_path):
    for r in range(2):
        steps(tmp_path, r, 0, 1, 20)
    final(tmp_path, 0, 20, "aa")
    final(tmp_path, 1, 20, "bb")
    assert summarize(tmp_path, 2, {}, 1.0)["replicas_bit_identical"] is False
    final(tmp_path, 1, 19, "aa")
    assert summarize(tmp_path, 2, {}, 1.0)["replicas_bit_identical"] is False
    final(tmp_path, 1, 20, "aa")
    s = summarize(tmp_path, 2, {}, 1.0)
    assert s["replicas_bit_identical"] is True and s["replicas_not_compared"] == []
