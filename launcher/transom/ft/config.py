"""What a FaultTolerant trainer is configured with, and the small pure helpers it shares:
`FTConfig` (the knobs of the fault-tolerant step; defaults from transom/defaults.py, TRANSOM_*
variables, explicit arguments), the learning-rate scaling for missing replicas, where a
model lives, and the digest that tells whether two replicas are bit-identical.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from transom import contract
from transom.contract import ENV_COLLECTIVE_TIMEOUT
from transom.defaults import LOCAL
from transom.ft import backend as placement
from transom.ft.ftar import DEFAULT_BUCKET_BYTES

LR_SCALING = ("none", "linear", "sqrt")

class Stateful(Protocol):
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class FTConfig:
    """Knobs of the fault-tolerant step. Explicit arguments win over TRANSOM_* variables."""

    collective_timeout_s: float = LOCAL.collective_timeout_s
    """A cross-replica collective that takes longer fails the step (a hung peer costs this)."""
    quorum_timeout_s: float = LOCAL.quorum_timeout_s
    """How long a step waits for its quorum (training paused below minReplicas) before raising."""
    recovery_timeout_s: float = LOCAL.recovery_timeout_s
    """How long a joining replica waits for its peer's state."""
    max_failed_steps: int = 10
    """Raise after this many failed attempts in a row."""
    lr_scaling: str = "sqrt"
    """How the learning rate follows the global batch when replicas are missing."""
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    recovery_bytes_per_s: float = 0
    """A cap on what each rank sends to catching-up replicas (0: none), so that a transfer
    leaves the link to the training traffic; a slower transfer only delays the joiner."""
    recovery_yields: bool = True
    """A catching-up replica fetches its snapshot only while its own cross-replica exchange
    is idle (ft/transfer.py LinkGate), so the transfer never slows the healthy replicas'
    all-reduce through its link. Off (TRANSOM_RECOVERY_YIELD=0) where the snapshot and the
    gradients travel separate networks (NCCL on InfiniBand, the transfer over Ethernet)."""
    recovery_chunk_bytes: int = 4 << 20
    """The unit a snapshot is served and checked in; smaller chunks spread a transfer more
    evenly over several sources."""
    catchup_buffer_bytes: int = 2 << 30
    """Memory a catching-up replica may hold in recorded updates (ft/catchup.py); past it, it
    asks for a newer snapshot."""
    backend: str | None = None
    """Backend of the cross-replica groups: auto, gloo or nccl (backend.py); None: ft.init()'s."""
    ddp_exchange: str = "wide"
    """Under DDP over a replica of several ranks (ft/inner_reduction.py): "wide", one
    all-reduce of each bucket over every rank of every replica (what DDP over all of them
    sends); or "slices", as HSDP: a reduce-scatter inside the replica, each rank's slice
    across replicas, an all-gather inside, for networks whose links inside a replica are
    much faster than those between replicas (Gloo's reduce-scatter costs more than an
    all-reduce of the whole bucket: docs/benchmarks.md)."""

    def __post_init__(self) -> None:
        if self.backend is not None:
            placement.requested(self.backend)  # raises BackendError with the choices
        if self.ddp_exchange not in contract.DDP_EXCHANGES:
            raise ValueError(f"ddp_exchange must be one of {contract.DDP_EXCHANGES}, got {self.ddp_exchange!r}")
        if self.lr_scaling not in LR_SCALING:
            raise ValueError(f"lr_scaling must be one of {LR_SCALING}, got {self.lr_scaling!r}")
        for name in ("collective_timeout_s", "quorum_timeout_s", "recovery_timeout_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):  # nan would compare false and never time out
                raise ValueError(f"{name} must be a positive, finite number of seconds, got {value}")
        if self.max_failed_steps < 1:
            raise ValueError("max_failed_steps must be at least 1")
        if not (math.isfinite(self.recovery_bytes_per_s) and self.recovery_bytes_per_s >= 0):
            raise ValueError(f"recovery_bytes_per_s must be >= 0, got {self.recovery_bytes_per_s}")
        if not 4096 <= self.recovery_chunk_bytes <= 1 << 30:
            raise ValueError(f"recovery_chunk_bytes must be between 4 KiB and 1 GiB, got {self.recovery_chunk_bytes}")
        if self.catchup_buffer_bytes < 0:
            raise ValueError(f"catchup_buffer_bytes must be >= 0, got {self.catchup_buffer_bytes}")

    @classmethod
    def from_environ(cls, **overrides: Any) -> FTConfig:
        env = {
            "collective_timeout_s": os.environ.get(ENV_COLLECTIVE_TIMEOUT),
            "quorum_timeout_s": os.environ.get(contract.ENV_QUORUM_TIMEOUT),
            "lr_scaling": os.environ.get(contract.ENV_LR_SCALING),
            "backend": os.environ.get(contract.ENV_BACKEND),
            "recovery_bytes_per_s": os.environ.get(contract.ENV_RECOVERY_BYTES_PER_S),
            "recovery_chunk_bytes": os.environ.get(contract.ENV_RECOVERY_CHUNK_BYTES),
            "ddp_exchange": os.environ.get(contract.ENV_DDP_EXCHANGE),
        }
        values: dict[str, Any] = {k: (float(v) if k.endswith("_s") else int(v) if k.endswith("_bytes") else v)
                                  for k, v in env.items() if v}
        yields = os.environ.get(contract.ENV_RECOVERY_YIELD)
        if yields:
            if yields not in ("0", "1"):
                raise ValueError(f"{contract.ENV_RECOVERY_YIELD} must be 0 or 1, got {yields!r}")
            values["recovery_yields"] = yields == "1"
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def lr_factor(scaling: str, participants: int, num_replicas: int) -> float:
    ratio = participants / num_replicas
    return {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[scaling]


def model_device(model: torch.nn.Module) -> torch.device:
    """Where the model's parameters (and so its gradients) are: the first one's device."""
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def state_digest(model: torch.nn.Module) -> str:
    """sha256 over the bytes of every tensor in the model's state, in key order."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        local = t.to_local() if hasattr(t, "to_local") else t
        h.update(name.encode())
        h.update(local.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def scales(scaler: Stateful | None) -> bool:
    """Whether an enabled AMP GradScaler owns inf/NaN gradients (a disabled one, on the CPU or
    with bf16, skips nothing: the guard judges the gradients then)."""
    is_enabled = getattr(scaler, "is_enabled", None)
    return scaler is not None and (not callable(is_enabled) or bool(is_enabled()))
