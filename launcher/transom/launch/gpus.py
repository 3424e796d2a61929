"""Which GPUs each replica of a local run (`transom run`) sees.

On Kubernetes every pod gets GPUs of its own from the device plugin. On one machine the
replicas would all see every GPU, and a cross-replica NCCL group between two processes on
one GPU is refused by NCCL. So when the machine has a GPU for every worker of every
replica, each replica gets its own slice (`CUDA_VISIBLE_DEVICES`), and NCCL can connect
them; with fewer GPUs they share them and the backend's `auto` picks Gloo for the
cross-replica groups (transom/ft/backend.py). A run that forces `--backend nccl` without
a GPU per worker is refused before it starts. No torch: the GPUs are listed by
`CUDA_VISIBLE_DEVICES` or `nvidia-smi`.
"""

from __future__ import annotations

import os
import shutil
import subprocess

NVIDIA_SMI_TIMEOUT_S = 10.0


def visible() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES entries (indices or UUIDs)."""
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip() and not d.strip().startswith("-")]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=NVIDIA_SMI_TIMEOUT_S, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in out.splitlines() if line.strip()]


def assign(gpus: list[str], replicas: int, workers_per_replica: int, backend: str) -> list[str | None]:
    """Per replica, its CUDA_VISIBLE_DEVICES (None: leave the environment as it is).

    Raises ValueError for `backend == "nccl"` without a GPU per worker.
    """
    needed = replicas * workers_per_replica
    if len(gpus) >= needed:
        return [",".join(gpus[r * workers_per_replica:(r + 1) * workers_per_replica]) for r in range(replicas)]
    if backend == "nccl":
        raise ValueError(
            f"--backend nccl needs a GPU per worker: {replicas} replica(s) x {workers_per_replica} process(es) = "
            f"{needed} workers, and this machine shows {len(gpus)} GPU(s); use --backend auto (Gloo where GPUs "
            "are shared) or run fewer workers")
    return [None] * replicas
