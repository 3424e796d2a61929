"""What a pre-flight check is given: the node's side of the job (`CheckContext`) and the
time it may take (`Budget`)."""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass, field

from transom.inject import Fault

DEVICES = ("cpu", "cuda")


@dataclass(frozen=True)
class CheckContext:
    """Where and how the checks run. Every field has a default that makes the checks that
    need no job (compute, memory, node's disk) run, and skips the others."""

    device: str = "cpu"
    """`cpu`, or `cuda`: the GPU forms (cuBLAS matmul, device memory, NCCL), on this process's
    current device (the collective check's ranks on devices 0 .. nproc-1)."""
    nproc: int = 1
    """Local ranks of the replica: the collective check all-reduces among this many processes."""
    checkpoint_uri: str | None = None
    """The storage check's location (a path, file:// or s3://); None skips it."""
    snapshot_bytes: int = 0
    """Free disk the node check requires under `snapshot_dir`."""
    snapshot_dir: str = field(default_factory=tempfile.gettempdir)
    coordinator_url: str | None = None
    """The node check measures clock skew against it; None skips that part."""
    token: str | None = None
    """Bearer token for the coordinator, if any (its /healthz needs none)."""
    peer_url: str | None = None
    """The link check's peer: a replica's state server base URL; None skips the check."""
    peer_token: str | None = None
    """Bearer token of the peers' state servers."""
    memory_bytes: int = 256 << 20
    """What the memory check allocates and tests (on the device)."""
    faults: tuple[Fault, ...] = ()
    """Injected faults of phase "preflight" (inject.preflight_faults)."""
    run_index: int = 0
    """Which pre-flight of this launcher this is: 0 the first, a spare's periodic ones count up."""

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if self.nproc < 1:
            raise ValueError(f"nproc must be at least 1, got {self.nproc}")
        for name in ("snapshot_bytes", "memory_bytes", "run_index"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)}")


@dataclass(frozen=True)
class Budget:
    """The time one check has: until `deadline` (time.monotonic()), or until `stop` is set
    (the runner stopped waiting for it: a check that holds processes lets go of them).
    `given`: the seconds it had when it started."""

    deadline: float
    given: float
    stop: threading.Event = field(default_factory=threading.Event)

    def left(self) -> float:
        return max(0.0, self.deadline - time.monotonic())

    def over(self) -> bool:
        return self.stop.is_set() or time.monotonic() >= self.deadline
