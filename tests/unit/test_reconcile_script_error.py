"""A pod whose launcher exited EXIT_SCRIPT_ERROR (the script raised a ScriptError) ends the job:
nothing is replaced, no node is excluded, and the job is Failed with reason ScriptError and
a message that names the pod, the error and what to do. Run against the simulated world."""

from __future__ import annotations

from datetime import timedelta

from reconcile_world import T0, World, cond, make_job
from transom import contract
from transom_operator import reasons
from transom_operator.reconcile import failures, observe
from transom_operator.reconcile.observe import ObservedNode

ERROR = "ScriptError: UsageError: a second backward pass in one step (rank 0)"


def script_error(w: World, name: str, message: str | None = ERROR) -> None:
    w.set_pod(name, phase="Failed", exit_code=contract.EXIT_SCRIPT_ERROR, reason="Error", message=message)


def test_a_script_error_fails_the_job_at_once_and_replaces_nothing():
    w = World(make_job(ft={"maxReplicaRestarts": 10})).running()
    script_error(w, "demo-r1-n0-g0")
    p = w.step()
    assert p.create == [] and p.relabel == [] and p.excluded_nodes_added == []
    # The other pods stop (they would hold GPUs for nothing); the failed one stays for its log.
    assert sorted(p.delete) == sorted(n for n in w.pods if n != "demo-r1-n0-g0")
    s = p.status
    assert s.state == "Failed" and s.total_restarts == 0 and s.restart_history == [] and s.excluded_nodes == []
    failed = cond(s, "Failed")
    assert failed.status == "True" and failed.reason == reasons.SCRIPT_ERROR
    assert cond(s, "Ready").reason == reasons.SCRIPT_ERROR
    assert "pod demo-r1-n0-g0" in failed.message and ERROR in failed.message and "fix the script" in failed.message
    r1 = s.replicas[1]
    assert (r1.state, r1.generation, r1.restarts, r1.last_failure.reason) == ("Failed", 0, 0, reasons.SCRIPT_ERROR)
    assert [(t, r) for t, r, _ in p.events] == [(reasons.WARNING, reasons.EVENT_JOB_FAILED)]
    # Final: later passes keep the reason and the message, and do nothing.
    w.settle()
    assert list(w.pods) == ["demo-r1-n0-g0"]
    w.now += timedelta(minutes=5)
    p = w.step()
    assert (p.create, p.delete) == ([], []) and cond(p.status, "Failed").reason == reasons.SCRIPT_ERROR
    assert cond(p.status, "Failed").message == failed.message
    w.assert_quiet()


def test_a_script_error_is_never_blamed_on_the_node_even_after_another_failure_there():
    w = World(make_job(ft={"maxReplicaRestarts": 10})).running()
    first = w.pod_of(0)
    w.set_pod(first.name, phase="Failed", exit_code=1)
    w.step()
    w.settle()
    w.step()
    victim = w.pod_of(2)
    w.set_pod(victim.name, node_name=first.node_name)  # a second failure on that node, but the script's
    script_error(w, victim.name)
    p = w.step()
    assert p.excluded_nodes_added == [] and p.status.excluded_nodes == []
    assert cond(p.status, "Failed").reason == reasons.SCRIPT_ERROR and p.create == []


def test_a_script_error_wins_over_a_node_failure_of_the_same_replica():
    w = World(make_job()).running()
    script_error(w, "demo-r1-n0-g0", message=None)
    other = w.pod_of(1, rank=1)
    w.nodes[other.node_name] = ObservedNode(other.node_name, False, T0 - timedelta(hours=1))
    p = w.step()
    failed = cond(p.status, "Failed")
    assert failed.reason == reasons.SCRIPT_ERROR and "its log has the traceback" in failed.message
    assert p.excluded_nodes_added == [] and p.create == []


def test_exit_4_of_a_deleted_pod_is_a_deletion_and_another_exit_code_an_ordinary_failure():
    w = World(make_job()).running()
    w.set_pod("demo-r0-n0-g0", deleting=True, phase="Failed", exit_code=contract.EXIT_SCRIPT_ERROR)
    w.set_pod("demo-r2-n0-g0", phase="Failed", exit_code=contract.EXIT_WORKERS_FAILED, message="ignored")
    p = w.step()
    assert p.status.state == "Degraded" and len(p.create) == 4  # both replaced: two of three replicas down
    assert [r.last_failure.reason for r in p.status.replicas if r.last_failure] == [reasons.POD_DELETED,
                                                                                   reasons.POD_FAILED]


def test_a_ready_spare_does_not_take_over_from_a_script_error():
    w = World(make_job(spareReplicas=1), num_nodes=12).running()
    w.settle()
    w.step()
    script_error(w, "demo-r0-n1-g0")
    p = w.step()
    assert p.relabel == [] and p.create == [] and cond(p.status, "Failed").reason == reasons.SCRIPT_ERROR
    assert {n for n in w.pods if n.startswith("demo-s0")} <= set(p.delete)


def test_the_termination_message_is_read_and_bounded():
    raw = {"metadata": {"name": "demo-r0-n0-g0"}, "status": {"phase": "Failed", "containerStatuses": [
        {"name": "t", "state": {"terminated": {"exitCode": 4, "message": ERROR}}}]}}
    pod = observe.observe_pod(raw)
    assert (pod.exit_code, pod.message) == (contract.EXIT_SCRIPT_ERROR, ERROR)
    long = observe.observe_pod({**raw, "status": {"phase": "Failed", "containerStatuses": [
        {"name": "t", "state": {"terminated": {"exitCode": 4, "message": "x" * 10000}}}]}})
    assert len(failures.script_error_message(long)) < failures.MAX_TERMINATION_MESSAGE + 200
