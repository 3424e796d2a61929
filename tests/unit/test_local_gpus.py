"""How `transom run` shares out a machine's GPUs between replicas (launch/gpus.py)."""

import pytest

from transom.launch import gpus


def test_a_gpu_per_worker_gives_each_replica_its_own_slice():
    assert gpus.assign(["0", "1", "2", "3"], 2, 2, "auto") == ["0,1", "2,3"]
    assert gpus.assign(["0", "1", "2", "3", "4"], 3, 1, "nccl") == ["0", "1", "2"]


@pytest.mark.parametrize("visible", [[], ["0"], ["0", "1"]])
def test_fewer_gpus_than_workers_are_shared(visible):
    assert gpus.assign(visible, 3, 1, "auto") == [None, None, None]


def test_forced_nccl_without_a_gpu_per_worker_is_refused_before_the_run():
    with pytest.raises(ValueError, match=r"3 replica\(s\) x 1 process\(es\) = 3 workers, and this machine shows 1 GPU"):
        gpus.assign(["0"], 3, 1, "nccl")


def test_visible_follows_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-a, GPU-b")
    assert gpus.visible() == ["GPU-a", "GPU-b"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert gpus.visible() == []
