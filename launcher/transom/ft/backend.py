"""Which torch.distributed backend serves which traffic, decided from where the tensors live.

Two kinds of groups carry a replica's traffic, and they are decided apart:

- the replica's own world (DDP/FSDP2 inside the replica, `init()`): NCCL only when every
  process of the replica on this host has a GPU of its own, and then as the device-mapped
  `cpu:gloo,cuda:nccl`, so that CPU tensors still work (a model left on the CPU, object
  collectives); otherwise Gloo;
- the cross-replica groups that FTAR averages over (`process_group.CrossReplicaGroup`):
  NCCL only when the gradients are on CUDA *and* the members of the group sit on distinct
  GPUs. NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"),
  which is exactly what several replicas on a workstation or in a test are. Otherwise Gloo,
  which takes CUDA tensors too (it stages them through host memory).

`auto` (the default) picks as above. `gloo` and `nccl` force a backend; a forced `nccl`
that cannot work is refused with a `BackendError` that says what to change, before any
step runs, instead of surfacing as ten failed steps. The functions here are pure: the
callers pass what they observed (CUDA devices, the gradients' device, the members' GPUs).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from transom import contract
from transom.contract import BACKENDS, DEFAULT_BACKEND
from transom.errors import BackendError  # noqa: F401  (raised here; the family lives in errors.py)


def requested(value: str | None = None) -> str:
    """The backend asked for: `value`, else TRANSOM_BACKEND, else auto. Checked."""
    choice = value if value is not None else (os.environ.get(contract.ENV_BACKEND) or DEFAULT_BACKEND)
    if choice not in BACKENDS:
        raise BackendError(f"backend must be one of {', '.join(BACKENDS)}, got {choice!r}")
    return choice


def replica_world(choice: str, *, cuda_devices: int, local_world_size: int) -> str:
    """The backend string for `init_process_group` of the replica's own world."""
    own_gpus = cuda_devices >= local_world_size > 0
    if choice == "gloo":
        return "gloo"
    if choice == "nccl":
        if cuda_devices == 0:
            raise BackendError("backend nccl needs CUDA, and this process sees no GPU: use backend gloo or auto")
        if not own_gpus:
            raise BackendError(
                f"backend nccl needs one GPU per process: this replica runs {local_world_size} processes on a "
                f"host where they see {cuda_devices} GPU(s); run fewer processes per replica, or use backend "
                "gloo or auto")
        return "nccl"
    return "cpu:gloo,cuda:nccl" if own_gpus else "gloo"


def local_device_index(local_rank: int, cuda_devices: int) -> int | None:
    """The CUDA device of a local rank: its own where there are enough, shared round-robin
    otherwise (Gloo serves shared GPUs), None without CUDA."""
    if cuda_devices == 0:
        return None
    return local_rank % cuda_devices


def cross_replica(choice: str, *, tensor_device: str, member_gpus: Sequence[str | None]) -> str:
    """The backend of one cross-replica group.

    `tensor_device`: the device type of the gradients ("cpu", "cuda"). `member_gpus`: for
    each member of the group, an id of its GPU unique across hosts (None for a member
    without one); every member passes the same list, so every member decides the same.
    """
    shared = _shared(member_gpus)
    if choice == "gloo":
        return "gloo"
    if choice == "nccl":
        if tensor_device != "cuda":
            raise BackendError(
                f"backend nccl needs the gradients on a CUDA device, and the model is on {tensor_device}: move the "
                "model to ctx.device before creating FaultTolerant, or use backend gloo or auto")
        if shared:
            raise BackendError(
                f"backend nccl cannot connect replicas that share a GPU (members {shared} use the same one): give "
                "each replica GPUs of its own, or use backend gloo or auto (Gloo carries CUDA tensors too)")
        return "nccl"
    return "nccl" if tensor_device == "cuda" and not shared and all(member_gpus) else "gloo"


def _shared(member_gpus: Sequence[str | None]) -> list[int]:
    """Indices of the members whose GPU another member also uses."""
    seen: dict[str, int] = {}
    shared: set[int] = set()
    for i, gpu in enumerate(member_gpus):
        if gpu is None:
            continue
        if gpu in seen:
            shared.update((seen[gpu], i))
        seen.setdefault(gpu, i)
    return sorted(shared)
