"""OOM kills as the operator sees them (reconcile/oom.py), run against the simulated world: a
pod that ended OOMKilled is replaced without blaming its node, a kill its launcher restarted
in place shows as the replica's lastFailure with an Event, and repeated kills end the job with
reason OOMKilled and a message that says what to change, in bounded time, never a crash loop."""

from __future__ import annotations

from datetime import timedelta

from reconcile_world import T0, World, cond, make_job
from transom import contract, defaults
from transom_operator import api, reasons
from transom_operator.reconcile import observe, oom

ADVICE = "raise resources.limits.memory or lower the batch size"


def oom_killed(w: World, name: str, **changes) -> None:
    """The pod's container ended as the kubelet reports an OOM kill of the launcher itself."""
    w.set_pod(name, **{"phase": "Failed", "exit_code": 137, "reason": "OOMKilled", "memory_limit": "3Gi", **changes})


def replace_after_oom(w: World, replica: int) -> object:
    oom_killed(w, w.pod_of(replica).name)
    p = w.step()
    w.settle()
    w.step()
    return p


def test_an_oom_killed_pod_is_replaced_with_reason_oomkilled_and_its_node_is_not_blamed():
    w = World(make_job()).running()
    first = w.pod_of(0)
    w.set_pod(first.name, phase="Failed", exit_code=1)  # an earlier failure on that node
    w.step()
    w.settle()
    w.step()
    victim = w.pod_of(2)
    w.set_pod(victim.name, node_name=first.node_name)
    oom_killed(w, victim.name)
    p = w.step()
    assert p.excluded_nodes_added == [] and p.status.excluded_nodes == []  # not RepeatedFailures
    r2 = p.status.replicas[2]
    assert (r2.generation, r2.restarts, r2.last_failure.reason) == (1, 1, reasons.OOM_KILLED)
    assert r2.last_failure.message == f"pod {victim.name} on node {first.node_name} was OOMKilled (memory limit 3Gi)"
    assert [h.reason for h in p.status.restart_history] == [reasons.POD_FAILED, reasons.OOM_KILLED]
    assert (reasons.WARNING, reasons.EVENT_REPLICA_FAILED) in [(t, r) for t, r, _ in p.events]
    assert p.status.state == "Recovering" and len(p.create) == 2


def test_repeated_oom_kills_of_one_replica_end_the_job_with_what_to_change():
    w = World(make_job(ft={"maxReplicaRestarts": 10})).running()
    for _ in range(defaults.OOM_KILL_LIMIT - 1):
        p = replace_after_oom(w, 1)
        assert p.status.state != "Failed" and len(p.create) == 2
    oom_killed(w, w.pod_of(1).name)
    p = w.step()
    message = f"replica 1 was OOMKilled {defaults.OOM_KILL_LIMIT} times at memory limit 3Gi: {ADVICE}"
    failed = cond(p.status, "Failed")
    assert (p.status.state, failed.status, failed.reason, failed.message) == ("Failed", "True", reasons.OOM_KILLED,
                                                                              message)
    assert cond(p.status, "Ready").reason == reasons.OOM_KILLED
    assert (reasons.WARNING, reasons.EVENT_JOB_FAILED, message) in p.events
    assert p.create == [] and p.status.replicas[1].state == "Failed"
    assert p.status.replicas[1].last_failure.reason == reasons.OOM_KILLED
    w.settle()
    w.now += timedelta(minutes=5)
    p = w.step()
    assert (p.create, p.delete) == ([], []) and cond(p.status, "Failed").message == message
    w.assert_quiet()


def test_oom_kills_outside_the_restart_window_or_of_other_replicas_do_not_add_up():
    w = World(make_job(ft={"maxReplicaRestarts": 10, "restartWindowSeconds": 600})).running()
    replace_after_oom(w, 0)
    replace_after_oom(w, 2)  # another replica's: its own count
    w.now += timedelta(seconds=601)
    replace_after_oom(w, 0)  # the first one is out of the window
    oom_killed(w, w.pod_of(0).name)
    p = w.step()
    assert p.status.state != "Failed" and len(p.create) == 2  # the window holds only two of replica 0's


def test_a_launcher_that_gave_up_on_oom_kills_ends_the_job_at_once():
    w = World(make_job(ft={"maxReplicaRestarts": 10})).running()
    said = f"{contract.OOM_KILLED}: " + contract.oom_advice("replica 1", 3, "3Gi")
    oom_killed(w, "demo-r1-n1-g0", exit_code=contract.EXIT_OOM_KILLED, message=said)
    p = w.step()
    failed = cond(p.status, "Failed")
    assert (failed.reason, failed.message) == (reasons.OOM_KILLED, f"replica 1 was OOMKilled 3 times at memory limit "
                                                                   f"3Gi: {ADVICE}")
    assert p.create == [] and p.status.total_restarts == 0 and p.status.excluded_nodes == []
    node = w.pods["demo-r1-n1-g0"].node_name
    assert p.status.replicas[1].last_failure.message.startswith(
        f"pod demo-r1-n1-g0 on node {node} was OOMKilled (memory limit 3Gi): replica 1 was OOMKilled 3 times")


def test_the_termination_message_alone_and_exit_5_without_a_limit_are_oom_kills():
    w = World(make_job(ft={"maxReplicaRestarts": 10})).running()
    w.set_pod("demo-r0-n0-g0", phase="Failed", exit_code=contract.EXIT_WORKERS_FAILED, reason="Error",
              message="OOMKilled: replica 0 was OOMKilled 1 time at memory limit 1Gi: ...")
    w.set_pod("demo-r2-n0-g0", phase="Failed", exit_code=contract.EXIT_OOM_KILLED, reason="Error")
    p = w.step()
    assert [r.last_failure.reason for r in p.status.replicas if r.last_failure] == [reasons.OOM_KILLED] * 2
    assert cond(p.status, "Failed").message == ("replica 2 was OOMKilled 3 times with no memory limit: lower the batch "
                                                "size or use larger nodes")


def test_a_kill_restarted_in_place_is_the_replicas_last_failure_with_an_event_once():
    w = World(make_job()).running()
    record = {"replica": 1, "generation": 0, "count": 1, "time": "2025-01-01T00:00:05Z",
              "message": "worker rank 0 was OOMKilled (memory limit 3Gi)"}
    w.coordinator(step=7, oomKills=[record])
    p = w.step()
    assert (p.create, p.delete) == ([], [])
    r1 = p.status.replicas[1]
    assert (r1.state, r1.generation, r1.restarts) == ("Running", 0, 0)
    assert r1.last_failure == api.Failure(
        reason=reasons.OOM_KILLED, time=T0 + timedelta(seconds=5),
        message="worker rank 0 was OOMKilled (memory limit 3Gi); restarted in place (1 OOM kill of this replica "
                "reported)")
    assert p.events == [(reasons.WARNING, reasons.OOM_KILLED, f"Replica 1 generation 0: {r1.last_failure.message}")]
    assert p.status.state == "Running" and p.status.total_restarts == 0
    w.assert_quiet()
    w.coordinator(step=9, oomKills=[{**record, "count": 2, "time": "2025-01-01T00:00:09Z"}])
    assert [r for _, r, _ in w.step().events] == [reasons.OOM_KILLED]  # the next kill: news again
    w.assert_quiet()


def test_a_kill_in_place_of_an_older_generation_is_not_shown_again():
    w = World(make_job()).running()
    replace_after_oom(w, 1)
    w.coordinator(oomKills=[{"replica": 1, "generation": 0, "count": 1, "time": "2025-01-01T00:00:05Z"}])
    p = w.step()
    assert p.events == [] and p.status.replicas[1].generation == 1
    assert p.status.replicas[1].last_failure.message.startswith("pod demo-r1-n0-g0 on node")


def test_the_pods_oom_reason_and_its_containers_memory_limit_are_read():
    raw = {"metadata": {"name": "demo-r0-n0-g0"},
           "spec": {"containers": [{"name": "side", "resources": {"limits": {"memory": "1Gi"}}},
                                   {"name": "trainer", "resources": {"limits": {"memory": "3Gi", "cpu": "2"}}}]},
           "status": {"phase": "Failed", "containerStatuses": [
               {"name": "trainer", "state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}}
    pod = observe.observe_pod(raw)
    assert (pod.exit_code, pod.reason, pod.memory_limit) == (137, "OOMKilled", "3Gi") and oom.is_oom_killed(pod)
    running = observe.observe_pod({**raw, "status": {"phase": "Running"}})
    assert running.memory_limit is None and not oom.is_oom_killed(running)


def test_a_fault_in_the_templates_env_reaches_every_worker_pod_as_the_chaos_harness_sets_it():
    from transom_operator import resources

    fault = {"name": contract.ENV_FAULT, "value": "oom:replica=1,step=20;oom:replica=1,step=20"}
    job = make_job(template={"spec": {"containers": [
        {"name": "t", "image": "t:1", "env": [fault], "resources": {"limits": {"memory": "3Gi"}}}]}})
    for replica in range(3):
        (container,) = resources.worker_pod(job, replica, 0, 0)["spec"]["containers"]
        assert fault in container["env"] and container["resources"]["limits"]["memory"] == "3Gi"
