"""A hang names the rank that never arrived (issue 33), in a real multi-process run.

Three replicas of two processes each (`transom run --nproc-per-replica 2`); rank 1 of replica 2
hangs just before the step's cross-replica all-reduce (transom/inject.py `hang`, phase
allreduce), so it never enters it: rank 1 of replicas 0 and 1 waits in the all-reduce for it,
and rank 0 of replica 2 waits for it in the replica's commit vote. The coordinator compares the
ranks' collective counts (transom/collective_counts.py, detect/hangs.py) and its verdict names
replica 2's rank 1, with the evidence, and no other replica is blamed.
"""

from __future__ import annotations

import json
import re

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_hang_names_the_rank_that_never_entered_the_all_reduce(transom_run):
    result = transom_run(["--replicas", "3", "--nproc-per-replica", "2",
                          "--detection", json.dumps({"hangTimeoutSeconds": 5}),
                          "--inject", "hang:replica=2,step=12,rank=1", "--end-on", "verdict:2"], ["--steps", "500"])
    # The job ends a few steps after the verdict, before replica 2's new incarnation is back.
    s = result.summary
    assert result.returncode == 0, result.output[-3000:]
    assert s["completed_step"] == result.end_step() and s["replicas_finished"] >= 2, s
    # Verdicts that acted (a FailSlow one, from this shared machine's noise, is only reported).
    found = [e for e in result.summary["events"] if e.startswith("verdict:") and "(Replace)" in e]
    assert len(found) == 1 and "replica 2: Hang" in found[0], found
    assert not [e for e in result.summary["events"] if "Hang" in e and "replica 2" not in e]
    verdict = found[0]
    assert "the hang waits for rank 1 of replica 2:" in verdict, verdict
    # The evidence: its own replica's counts (rank 0 entered one collective more, the commit
    # vote, and waits in it), and the other replicas' rank 1 waiting in the all-reduce for it.
    evidence = re.search(r"rank 1 of replica 2 entered (\d+) of its replica's collectives, "
                         r"the others \(rank 0\) entered (\d+) and wait in it", verdict)
    assert evidence is not None and int(evidence[2]) == int(evidence[1]) + 1, verdict
    assert "rank 1 of replicas 0, 1 entered all-reduce" in verdict, verdict
    assert result.incarnations(0) == result.incarnations(1) == 1
    # The verdict acted on replica 2: declared failed, so its launcher restarts it.
    assert any(e.startswith("failed: replica 2: ") for e in result.summary["events"]), result.summary["events"]
