"""The status write is the change, and only the change: applied to what the API server has,
the operations give what the plan wants (status_diff.py)."""

from __future__ import annotations

import copy

import pytest

from transom_operator.reconcile.status_diff import status_ops


class GuardFailed(Exception):
    pass


def apply(job: dict, ops: list[dict]) -> dict:
    """A JSON patch (RFC 6902) for the operations status_ops emits: add, replace, test."""
    job = copy.deepcopy(job)
    for op in ops:
        *parents, last = [t.replace("~1", "/").replace("~0", "~") for t in op["path"].split("/")[1:]]
        target = job
        for token in parents:
            target = target[int(token)] if isinstance(target, list) else target[token]
        key = int(last) if isinstance(target, list) else last
        if op["op"] == "test":
            if target[key] != op["value"]:
                raise GuardFailed(op["path"])
        elif op["op"] == "replace":
            target[key]  # must exist  # noqa: B018
            target[key] = copy.deepcopy(op["value"])
        elif op["op"] == "add":
            assert not isinstance(target, list)
            target[key] = copy.deepcopy(op["value"])
        else:
            raise AssertionError(op)
    return job


def replicas(n: int, **changes) -> list[dict]:
    out = [{"id": i, "generation": 0, "restarts": 0, "state": "Running", "nodes": [f"node-{i}"]} for i in range(n)]
    for index, fields in changes.items():
        out[int(index.removeprefix("r"))].update(fields)
    return out


def test_nothing_changed_writes_nothing():
    status = {"state": "Running", "replicas": replicas(250), "training": {"step": 7}}
    wanted = {k: v for k, v in status.items() if k != "training"}
    assert status_ops(copy.deepcopy(status), wanted) == []


def test_one_replaced_replica_is_one_entry_guarded_by_its_id():
    current = {"state": "Running", "totalRestarts": 0, "replicas": replicas(250), "training": {"step": 7}}
    wanted = {"state": "Recovering", "totalRestarts": 1,
              "replicas": replicas(250, r17={"generation": 1, "restarts": 1, "state": "Replacing"})}
    ops = status_ops(current, wanted)
    assert {op["path"] for op in ops} == {"/status/state", "/status/totalRestarts", "/status/replicas/17",
                                          "/status/replicas/17/id"}
    after = apply({"status": current}, ops)["status"]
    assert after == {**wanted, "training": {"step": 7}}  # the coordinator's part untouched


def test_a_list_changed_meanwhile_fails_the_guard_instead_of_writing_the_wrong_entry():
    current = {"replicas": replicas(3)}
    ops = status_ops(current, {"replicas": replicas(3, r1={"generation": 1})})
    moved = {"replicas": [current["replicas"][0], current["replicas"][2], current["replicas"][1]]}
    with pytest.raises(GuardFailed):
        apply({"status": moved}, ops)


@pytest.mark.parametrize("wanted", [
    {"replicas": replicas(4)},  # scaled up: another length
    {"replicas": replicas(3)[::-1]},  # other ids at the same places
])
def test_a_list_of_another_shape_is_written_whole(wanted):
    current = {"replicas": replicas(2)}
    ops = status_ops(current, wanted)
    assert ops == [{"op": "add", "path": "/status/replicas", "value": wanted["replicas"]}]
    assert apply({"status": current}, ops)["status"] == wanted


def test_a_job_without_status_gets_it_whole_and_members_not_planned_stay():
    wanted = {"state": "Pending", "replicas": replicas(2)}
    assert apply({}, status_ops(None, wanted)) == {"status": wanted}
    # A member the plan does not set any more is left as a merge patch would leave it.
    current = {"state": "Running", "observedGeneration": 3}
    assert apply({"status": current}, status_ops(current, {"state": "Degraded"}))["status"] == \
        {"state": "Degraded", "observedGeneration": 3}
