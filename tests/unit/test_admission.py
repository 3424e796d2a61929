"""Kueue admission (reconcile/admission.py): the Workload of a queued job, what its status
allows, and the replica policy of a job that waits, is admitted, loses a replica and is evicted."""

from __future__ import annotations

from datetime import timedelta

from reconcile_world import T0, World, cond, make_job
from transom import contract
from transom_operator import api, reasons
from transom_operator.reconcile import admission as kueue

QUEUE = "team-a"
FLAVOR = {"metadata": {"name": "gpu-a"}, "spec": {
    "nodeLabels": {"pool": "a"}, "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule"}]}}


def queued_job(**spec) -> api.TrainingJob:
    job = make_job(**spec)
    return job.model_copy(update={"metadata": {**job.metadata, "labels": {kueue.QUEUE_LABEL: QUEUE}}})


def workload(job: api.TrainingJob, *conditions: dict, admission: dict | None = None) -> dict:
    wl = kueue.workload(job, QUEUE)
    wl["metadata"].update(resourceVersion="7", generation=1)
    wl["status"] = {"conditions": list(conditions), **({"admission": admission} if admission else {})}
    return wl


def condition(type_: str, status: str = "True", reason: str = "R", message: str = "") -> dict:
    return {"type": type_, "status": status, "reason": reason, "message": message,
            "lastTransitionTime": "2025-01-01T00:00:00Z"}


ADMISSION = {"clusterQueue": "cluster-queue", "podSetAssignments": [
    {"name": "worker", "flavors": {"cpu": "gpu-a", "memory": "gpu-a"}, "count": 6}]}


def admitted(job: api.TrainingJob) -> kueue.Admission:
    wl = workload(job, condition("QuotaReserved"), condition("Admitted"), admission=ADMISSION)
    return kueue.read(wl, {"gpu-a": FLAVOR})


def test_workload_is_the_jobs_pods_in_one_gang():
    job = queued_job(spareReplicas=1, template={"spec": {"containers": [{
        "name": "t", "image": "t:1", "resources": {"requests": {"cpu": "2"}},
        "env": [{"name": "SECRET_ISH", "value": "x"}], "command": ["python", "train.py"]}]}})
    wl = kueue.workload(job, QUEUE)
    assert wl["spec"]["queueName"] == QUEUE and "finalizers" not in wl["metadata"]  # goes with the job
    assert wl["metadata"]["ownerReferences"][0]["uid"] == "u1"
    assert wl["metadata"]["labels"][contract.LABEL_JOB] == "demo"
    assert [(s["name"], s["count"]) for s in wl["spec"]["podSets"]] == [("worker", 6), ("spare", 2)]
    [container] = wl["spec"]["podSets"][0]["template"]["spec"]["containers"]
    assert container == {"name": "t", "image": "t:1", "resources": {"requests": {"cpu": "2"}}}  # no env, no command
    name = kueue.workload_name(job)
    assert name.startswith("trainingjob-demo-") and len(name) == len("trainingjob-demo-") + 5
    long_job = job.model_copy(update={"metadata": {**job.metadata, "name": "x" * 63}})
    assert len(kueue.workload_name(long_job)) == kueue.MAX_NAME


def test_same_shape_until_the_job_changes_what_kueue_counts():
    job = queued_job()
    wl = kueue.workload(job, QUEUE)
    assert kueue.same_shape(wl, job, QUEUE)
    assert not kueue.same_shape(wl, job, "other-queue")
    assert not kueue.same_shape(wl, queued_job(replicas=4), QUEUE)
    bigger = queued_job(template={"spec": {"containers": [{"name": "t", "image": "t:1",
                                                             "resources": {"requests": {"cpu": "4"}}}]}})
    assert not kueue.same_shape(wl, bigger, QUEUE)


def test_read_waiting_admitted_evicted():
    job = queued_job()
    pending = kueue.read(workload(job, condition(
        "QuotaReserved", "False", "Pending", "couldn't assign flavors to pod set worker: insufficient unused quota "
        "for cpu in flavor default-flavor, 3 more needed")), {})
    assert not pending.admitted and pending.reason == "Pending"
    assert "insufficient unused quota for cpu" in pending.message and QUEUE in pending.message
    adm = admitted(job)
    assert adm.admitted and adm.reserved and "cluster-queue" in adm.message
    assert adm.placements["worker"] == kueue.Placement({"pool": "a"}, tuple(FLAVOR["spec"]["tolerations"]))
    evicted = kueue.read(workload(job, condition("Admitted"), condition("Evicted", reason="Preempted",
                                                                     message="preempted by a higher priority"),
                                  admission=ADMISSION), {})
    assert (evicted.admitted, evicted.evicted, evicted.reserved) == (False, True, True)
    assert "Preempted" in evicted.message


def test_a_queued_job_creates_no_pod_until_admitted_then_all_of_them_placed():
    w = World(queued_job())
    w.admission = kueue.waiting(QUEUE, "Pending", f"waiting in queue {QUEUE}: insufficient unused quota")
    p = w.step()
    assert p.create == [] and p.status.state == "Queued" and p.requeue_after <= 2.0
    assert cond(p.status, "Ready").reason == reasons.QUEUED
    assert (cond(p.status, "Admitted").status, cond(p.status, "Admitted").reason) == ("False", "Pending")
    assert (reasons.NORMAL, reasons.EVENT_JOB_QUEUED) in [(t, r) for t, r, _ in p.events]
    w.assert_quiet()
    w.admission = admitted(w.job)
    w.now += timedelta(seconds=30)
    p = w.step()
    assert len(p.create) == 6 and p.status.state == "Pending"
    for pod in p.create:
        assert pod["metadata"]["labels"][kueue.PODSET_LABEL] == "worker"
        assert pod["spec"]["nodeSelector"] == {"pool": "a"}
        assert pod["spec"]["tolerations"][-1] == FLAVOR["spec"]["tolerations"][0]
    assert cond(p.status, "Admitted").status == "True"
    assert [r for _, r, _ in p.events].count(reasons.EVENT_JOB_ADMITTED) == 1
    w.settle()
    w.step()
    assert w.job.status.state == "Running"
    w.assert_quiet()


def test_a_replacement_keeps_the_admission():
    w = World(queued_job())
    w.admission = admitted(w.job)
    w.running()
    since = cond(w.job.status, "Admitted").last_transition_time
    w.now += timedelta(seconds=60)
    w.set_pod(w.pod_of(1).name, phase="Failed", exit_code=1, finished=w.now)
    p = w.step()
    assert sorted(m["metadata"]["name"] for m in p.create) == ["demo-r1-n0-g1", "demo-r1-n1-g1"]
    assert all(m["spec"]["nodeSelector"] == {"pool": "a"} for m in p.create)
    assert p.status.state == "Recovering" and cond(p.status, "Admitted").last_transition_time == since
    assert reasons.EVENT_JOB_ADMITTED not in [r for _, r, _ in p.events]


def test_an_evicted_job_stops_its_pods_and_waits_again():
    w = World(queued_job())
    w.admission = admitted(w.job)
    w.running()
    w.admission = kueue.Admission(QUEUE, False, "Evicted", "evicted by Kueue (Preempted): by job b",
                                  evicted=True, reserved=True)
    p = w.step()
    assert sorted(p.delete) == sorted(w.pods) and p.create == []
    assert p.status.state == "Queued" and cond(p.status, "Admitted").reason == "Evicted"


def test_spec_suspend_wins_over_the_queue():
    w = World(queued_job(suspend=True))
    w.admission = kueue.waiting(QUEUE, "Pending", "waiting")
    assert w.step().status.state == "Suspended"


def test_release_gives_the_quota_back_as_jobframework_does():
    job = queued_job()
    wl = workload(job, condition("QuotaReserved", reason="QuotaReserved"), condition("Admitted", reason="Admitted"),
                  condition("Evicted", reason="Preempted", message="preempted"), admission=ADMISSION)
    patch = kueue.release_patch(wl, T0)
    assert patch["metadata"] == {"resourceVersion": "7"} and patch["status"]["admission"] is None
    by_type = {c["type"]: c for c in patch["status"]["conditions"]}
    assert (by_type["QuotaReserved"]["status"], by_type["QuotaReserved"]["reason"]) == ("False", "Pending")
    assert (by_type["Admitted"]["status"], by_type["Admitted"]["reason"]) == ("False", "NoReservation")
    assert (by_type["Requeued"]["status"], by_type["Requeued"]["reason"]) == ("True", "Preempted")
    assert by_type["Evicted"] == wl["status"]["conditions"][2]  # Kueue's own, untouched


def test_finished_and_the_finalizer():
    job = queued_job()
    wl = workload(job, condition("Admitted"), admission=ADMISSION)
    patch = kueue.finished_patch(wl, True, "the TrainingJob Succeeded", T0)
    finished = next(c for c in patch["status"]["conditions"] if c["type"] == "Finished")
    assert (finished["status"], finished["reason"]) == ("True", "Succeeded")
    assert kueue.without_finalizer(wl) is None
    wl["metadata"]["finalizers"] = [kueue.FINALIZER, "other"]
    assert kueue.without_finalizer(wl) == {"metadata": {"resourceVersion": "7", "finalizers": ["other"]}}
    assert kueue.read(workload(job, finished), {}).finished
