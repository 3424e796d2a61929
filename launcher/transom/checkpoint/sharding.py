"""State that FSDP2 shards across the ranks of a replica: DTensors, stored as local parts.

Under FSDP2 each rank of a replica holds a slice of every parameter and optimizer state, as
a DTensor. A checkpoint stores each rank's local tensor (no gather, no communication) with a
small description: the placements and the global shape and stride. Restoring into a
replica with the same number of ranks makes the DTensors again on the model's own device
mesh (`rebuilder`), so `model.load_state_dict` and `optimizer.load_state_dict` take them as
they are. A different number of ranks would need resharding, which this does not do: the
restore refuses it with a clear error.

`torch.distributed.tensor` is imported only where a DTensor exists: a process that never
made one (no FSDP2) cannot hold one, and that import takes a second or more, on every
replica's way to its first step.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeGuard

import torch

if TYPE_CHECKING:
    from torch.distributed.tensor import DeviceMesh, DTensor


def _is_dtensor(value: Any) -> TypeGuard[DTensor]:
    module = sys.modules.get("torch.distributed.tensor")  # not imported: no DTensor exists
    return module is not None and isinstance(value, module.DTensor)


def is_sharded(state: Any) -> bool:
    """True if any tensor in the nested state is a DTensor (the ranks hold different data)."""
    if _is_dtensor(value := state):
        return True
    if isinstance(value, dict):
        return any(is_sharded(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(is_sharded(v) for v in value)
    return False


def _placement(p: Any) -> list:
    from torch.distributed.tensor import Replicate, Shard

    if isinstance(p, Shard):
        return ["shard", p.dim]
    if isinstance(p, Replicate):
        return ["replicate"]
    raise ValueError(f"cannot checkpoint a DTensor placed as {p!r} (only Shard and Replicate)")


def _parse(p: list) -> Any:
    from torch.distributed.tensor import Replicate, Shard

    if p[0] == "shard":
        return Shard(int(p[1]))
    if p[0] == "replicate":
        return Replicate()
    raise ValueError(f"unknown placement {p!r} in checkpoint")


def localize(t: torch.Tensor) -> tuple[torch.Tensor, dict | None]:
    """(the tensor to store, its description): a DTensor's local part, anything else as is."""
    if not _is_dtensor(t):
        return t, None
    meta = {"placements": [_placement(p) for p in t.placements], "shape": list(t.shape), "stride": list(t.stride())}
    return t.to_local(), meta


def mesh_of(module: torch.nn.Module) -> DeviceMesh | None:
    """The device mesh of the module's first DTensor parameter, or None if it has none."""
    return next((p.device_mesh for p in module.parameters() if _is_dtensor(p)), None)


def rebuilder(mesh: DeviceMesh | None) -> Callable[[torch.Tensor, dict], torch.Tensor]:
    """Turns a stored local part back into a DTensor on `mesh`."""
    def rebuild(local: torch.Tensor, meta: dict) -> torch.Tensor:
        if mesh is None:
            raise ValueError("the checkpoint holds sharded (DTensor) state but the model has no DTensor parameters")
        from torch.distributed.tensor import DTensor

        placements = [_parse(p) for p in meta["placements"]]
        return DTensor.from_local(local.to(mesh.device_type), mesh, placements, run_check=False,
                                  shape=torch.Size(meta["shape"]), stride=tuple(meta["stride"]))
    return rebuild
