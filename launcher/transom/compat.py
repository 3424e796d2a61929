"""The few places where the supported torch versions (2.6 and later) differ, in one module.

Everything else in Transom uses public torch API that all supported versions share. What
differs, and how it is bridged:

- DCP's fsspec reader and writer are exported from `torch.distributed.checkpoint` only in
  recent torch; older ones keep them in `_fsspec_filesystem`.
- `dcp.load` / `dcp.async_save` take `no_dist=True` only in recent torch; older ones run
  without a process group when none is initialised, which is what `no_dist` asks for.
- A GPU's UUID (`get_device_properties(i).uuid`) is there in every supported torch, but
  is not on every build; the PCI bus id and the host name stand in for it.

`make test-compat` runs a smoke subset on the oldest supported torch (docs/testenv.md).
Imports torch: only for modules that already need it; DCP only where it is used (it takes
a second to import, on every replica's way to its first step).
"""

from __future__ import annotations

import inspect
import socket
from typing import Any

import torch

MIN_TORCH = (2, 6)


def torch_version() -> tuple[int, int]:
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def fsspec_writer(url: str, **kwargs: Any):
    """DCP's FsspecWriter for `url` (a directory or an s3:// prefix)."""
    try:
        from torch.distributed.checkpoint import FsspecWriter
    except ImportError:  # torch < 2.7
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    return FsspecWriter(url, **kwargs)


def fsspec_reader(url: str, **kwargs: Any):
    """DCP's FsspecReader for `url`."""
    try:
        from torch.distributed.checkpoint import FsspecReader
    except ImportError:  # torch < 2.7
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    return FsspecReader(url, **kwargs)


def _no_dist(fn: Any) -> dict[str, Any]:
    """`no_dist=True` where `fn` takes it; older torch infers it from an uninitialised world."""
    return {"no_dist": True} if "no_dist" in inspect.signature(fn).parameters else {}


def dcp_load(state: dict, checkpoint_id: str, **kwargs: Any) -> None:
    """`dcp.load` in this process alone (no process group), on any supported torch."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state, checkpoint_id=checkpoint_id, **_no_dist(dcp.load), **kwargs)


def dcp_async_save(state: dict, **kwargs: Any):
    """`dcp.async_save` in this process alone; returns its future."""
    import torch.distributed.checkpoint as dcp

    return dcp.async_save(state, **_no_dist(dcp.async_save), **kwargs)


def gpu_id(index: int) -> str:
    """An id of CUDA device `index` that no other GPU anywhere has: two processes with the
    same id share one GPU (NCCL cannot connect them)."""
    props = torch.cuda.get_device_properties(index)
    uuid = getattr(props, "uuid", None)
    if uuid:
        return f"GPU-{uuid}"
    bus = getattr(props, "pci_bus_id", None)
    return f"{socket.gethostname()}/{bus if bus is not None else index}"
