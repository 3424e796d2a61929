"""The step's fault-injection hooks (ft/hooks.py) and the typed quorum answer its ranks
share (ft/coordinator_link.py `read_outcome`): production gets hooks that never fire, and a fault
fires only at its own point, step and rank."""

from __future__ import annotations

import pytest

from transom.coordinator.models import QuorumResponse
from transom.ft import hooks
from transom.ft.coordinator_link import NoQuorumAnswer, read_outcome


def test_without_a_fault_for_this_attempt_the_step_gets_hooks_that_do_nothing():
    assert hooks.from_environ(0, replica=1, rank=0, environ={}) is hooks.NO_HOOKS
    # A fault for another replica, or for another attempt, is not this one's.
    assert hooks.from_environ(0, replica=1, rank=0, environ={"TRANSOM_FAULT": "raise:step=3,replica=0"}) \
        is hooks.NO_HOOKS
    assert hooks.from_environ(1, replica=1, rank=0, environ={"TRANSOM_FAULT": "raise:step=3"}) is hooks.NO_HOOKS
    for point in ("forward", "allreduce", "catchup", "serve", "checkpoint"):
        getattr(hooks.NO_HOOKS, point)(3)  # a no-op at every point, whatever the step


def test_an_injected_fault_fires_at_its_point_step_and_rank_only():
    fault = {"TRANSOM_FAULT": "raise:step=3,rank=1,phase=forward"}
    mine = hooks.from_environ(0, replica=1, rank=1, environ=fault)
    other_rank = hooks.from_environ(0, replica=1, rank=0, environ=fault)
    assert isinstance(mine, hooks.InjectedFaults)
    mine.forward(2)
    mine.allreduce(3)  # another point
    other_rank.forward(3)
    with pytest.raises(RuntimeError, match="injected fault at step 3"):
        mine.forward(3)


def test_the_answer_a_leader_hands_its_ranks_is_typed_again():
    q = QuorumResponse(round=4, quorum_id=2, members=[0, 1], rank=0, store_addr="h:1", store_prefix="p", max_step=9,
                       participants=2, recovering=[], serve_recovery=False)
    assert read_outcome(q.model_dump_json()) == q
    assert read_outcome({"evicted": "superseded", "state": "failed"}) == \
        NoQuorumAnswer(kind="evicted", message="superseded", state="failed")
    assert read_outcome({"completed": "the job completed at step 90"}).kind == "completed"
    assert read_outcome({"error": "TimeoutError: no quorum"}) == \
        NoQuorumAnswer(kind="error", message="TimeoutError: no quorum")
