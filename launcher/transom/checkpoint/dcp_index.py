"""The step's `.metadata`: DCP's own index of a Transom checkpoint, so `dcp.load` reads it.

Transom writes each part's data file in DCP's format (a `torch.save` blob per tensor, see
blob.py) and records where every blob lies in its own JSON manifest. From those records
the committer builds the `Metadata` object DCP's `FileSystemReader` expects (one chunk per
tensor, its file, offset and length) and pickles it into `<step>/.metadata`. So
`dcp.load(state, checkpoint_id="<uri>/step-N")` works on a Transom checkpoint, on any torch
from 2.6 on.

This file is written for DCP and never read by Transom: its own restore reads the JSON
manifest, and nothing Transom reads from storage is unpickled. The classes come from
`torch.distributed.checkpoint`'s metadata module (public) and `filesystem._StorageInfo`
(private, but the same three fields since torch 2.0). They are imported when a step is
committed, not with this module: `torch.distributed.checkpoint` takes a second to import,
and a restarted replica imports this module on its way to its first step.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterable

import torch

from transom.checkpoint import blob, layout


def build(entries: Iterable[layout.Entry]) -> bytes:
    """The pickled `Metadata` of a step whose tensors are `entries` (paths relative to the step)."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (
        STORAGE_TYPES,
        ChunkStorageMetadata,
        Metadata,
        MetadataIndex,
        TensorProperties,
        TensorStorageMetadata,
    )

    state_dict_metadata: dict[str, STORAGE_TYPES] = {}
    storage_data = {}
    for e in entries:
        size = torch.Size(e.shape)
        origin = torch.Size([0] * len(e.shape))
        state_dict_metadata[e.key] = TensorStorageMetadata(
            properties=TensorProperties(dtype=blob.DTYPES[e.dtype]),
            size=size,
            chunks=[ChunkStorageMetadata(offsets=origin, sizes=size)],
        )
        storage_data[MetadataIndex(fqn=e.key, offset=origin, index=0)] = _StorageInfo(
            relative_path=e.file, offset=e.offset, length=e.length)
    buf = io.BytesIO()
    pickle.dump(Metadata(state_dict_metadata=state_dict_metadata, storage_data=storage_data), buf)
    return buf.getvalue()
