"""Which backend serves which group: the pure decisions of transom.ft.backend."""

import pytest

from transom.ft import backend as b


@pytest.mark.parametrize("choice, gpus, procs, expected", [
    ("auto", 0, 1, "gloo"),                   # no GPU
    ("auto", 8, 8, "cpu:gloo,cuda:nccl"),     # a GPU per process; CPU tensors still go through Gloo
    ("auto", 1, 2, "gloo"),                   # two processes on one GPU: NCCL would refuse
    ("gloo", 8, 8, "gloo"),
    ("nccl", 8, 8, "nccl"),
])
def test_the_replicas_own_world(choice, gpus, procs, expected):
    assert b.replica_world(choice, cuda_devices=gpus, local_world_size=procs) == expected


@pytest.mark.parametrize("gpus, procs, message", [
    (0, 1, "sees no GPU"),
    (1, 2, "one GPU per process: this replica runs 2 processes on a host where they see 1 GPU"),
])
def test_a_forced_nccl_world_that_cannot_work_is_refused_with_what_to_change(gpus, procs, message):
    with pytest.raises(b.BackendError, match=message) as e:
        b.replica_world("nccl", cuda_devices=gpus, local_world_size=procs)
    assert "gloo or auto" in str(e.value)


@pytest.mark.parametrize("local_rank, gpus, expected", [(0, 0, None), (3, 8, 3), (2, 1, 0), (3, 2, 1)])
def test_device_of_a_local_rank(local_rank, gpus, expected):
    assert b.local_device_index(local_rank, gpus) == expected


@pytest.mark.parametrize("choice, device, members, expected", [
    ("auto", "cpu", [None, None, None], "gloo"),            # the model stayed on the CPU of a GPU machine
    ("auto", "cuda", ["GPU-a", "GPU-b", "GPU-c"], "nccl"),   # one GPU each: NCCL
    ("auto", "cuda", ["GPU-a", "GPU-a", "GPU-a"], "gloo"),   # replicas sharing a GPU: Gloo carries CUDA tensors
    ("auto", "cuda", ["GPU-a", "GPU-b", "GPU-a"], "gloo"),
    ("auto", "cuda", ["GPU-a", None], "gloo"),               # a member without a GPU id
    ("auto", "mixed (cpu, cuda)", ["GPU-a", None], "gloo"),
    ("gloo", "cuda", ["GPU-a", "GPU-b"], "gloo"),
    ("nccl", "cuda", ["GPU-a", "GPU-b"], "nccl"),
    ("nccl", "cuda", [], "nccl"),                           # the check at start, before any peer is known
])
def test_cross_replica_groups(choice, device, members, expected):
    assert b.cross_replica(choice, tensor_device=device, member_gpus=members) == expected


def test_forced_nccl_with_the_model_on_the_cpu_is_refused_at_start():
    with pytest.raises(b.BackendError, match="gradients on a CUDA device, and the model is on cpu: move the model"):
        b.cross_replica("nccl", tensor_device="cpu", member_gpus=[])


def test_forced_nccl_between_replicas_on_one_gpu_names_them_and_the_way_out():
    with pytest.raises(b.BackendError, match=r"share a GPU \(members \[0, 2\] use the same one\).*gloo or auto"):
        b.cross_replica("nccl", tensor_device="cuda", member_gpus=["GPU-a", "GPU-b", "GPU-a"])


def test_the_request_comes_from_the_argument_then_the_environment(monkeypatch):
    monkeypatch.delenv("TRANSOM_BACKEND", raising=False)
    assert b.requested() == "auto"
    monkeypatch.setenv("TRANSOM_BACKEND", "gloo")
    assert b.requested() == "gloo"
    assert b.requested("nccl") == "nccl"
    with pytest.raises(b.BackendError, match="backend must be one of auto, gloo, nccl, got 'mpi'"):
        b.requested("mpi")
