"""A replica's state as bytes for a recovering peer: tensor blobs plus a JSON index.

The same representation as a checkpoint (checkpoint/structure.py, checkpoint/blob.py): the
state is flattened into named tensors and a JSON skeleton, each tensor travels as a
`torch.save` blob, and the receiver rebuilds it without running anything the sender
provided: the index is JSON checked against a schema, each blob is cut out by offset and
read by `blob.decode` (raw storage bytes, the pickle never looked at), and the skeleton may
name only tensors that came along. Sharded (FSDP2) state travels as each rank's local part
and is rebuilt on the receiver's own device mesh, as from a checkpoint.

    MAGIC | blob | blob | ... | index (JSON) | len(index) as 8 bytes, little-endian

The index goes last so the sender streams blobs into one buffer without a second copy.
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Callable
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from transom.checkpoint import blob, structure
from transom.checkpoint.tensor_entry import TensorEntry
from transom.errors import WireError  # noqa: F401  (raised here; the family lives in errors.py)

MAGIC = b"transom-state/1\n"
MAX_INDEX_BYTES = 256 << 20
_LENGTH = struct.Struct("<Q")


class _Entry(TensorEntry):
    """A tensor of the message: its blob's place in the payload."""

    offset: int = Field(ge=0)
    length: int = Field(ge=0)

    @model_validator(mode="after")
    def _fits(self) -> _Entry:
        if self.length < self.size:
            raise ValueError(f"{self.key}: {self.length} bytes cannot hold {self.dtype}{self.shape}")
        return self


class _Index(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    entries: list[_Entry]
    skeleton: Any


def encode(state: Any, localize: Callable[[Any], tuple[Any, dict | None]] | None = None) -> bytes:
    """`state` (nested dicts, lists, tuples, numbers, strings, None, tensors) as bytes."""
    tensors, skeleton = structure.flatten(state, torch.is_tensor, localize)
    out = io.BytesIO()
    out.write(MAGIC)
    entries = []
    for key, t in tensors.items():
        offset = out.tell()
        blob.write(t.detach().cpu(), out)
        entries.append({"key": key, "dtype": blob.dtype_name(t.dtype), "shape": list(t.shape),
                        "offset": offset, "length": out.tell() - offset})
    index = json.dumps({"entries": entries, "skeleton": skeleton}, separators=(",", ":")).encode()
    out.write(index)
    out.write(_LENGTH.pack(len(index)))
    return out.getvalue()


def decode(data: bytes | bytearray, device: torch.device | str = "cpu",
           rebuild: Callable[[torch.Tensor, dict], Any] | None = None) -> Any:
    """The state `encode` made; WireError if `data` is anything else."""
    view = memoryview(data)
    if len(view) < len(MAGIC) + _LENGTH.size or bytes(view[:len(MAGIC)]) != MAGIC:
        raise WireError("not a Transom state (bad header)")
    (n,) = _LENGTH.unpack(view[-_LENGTH.size:])
    end = len(view) - _LENGTH.size
    if n > MAX_INDEX_BYTES or n > end - len(MAGIC):
        raise WireError(f"index of {n} bytes does not fit")
    try:
        index = _Index.model_validate(json.loads(bytes(view[end - n:end])))
        referenced = structure.tensor_keys(index.skeleton)
    except ValidationError as e:
        raise WireError(f"bad index: {e.errors()[0]['msg']}") from None
    except (ValueError, RecursionError) as e:
        raise WireError(f"bad index: {e}") from None
    keys = [entry.key for entry in index.entries]
    if len(set(keys)) != len(keys) or not set(referenced) <= set(keys):
        raise WireError("the index and the skeleton disagree about the tensors")
    tensors: dict[str, torch.Tensor] = {}
    for entry in index.entries:
        if entry.offset < len(MAGIC) or entry.offset + entry.length > end - n:
            raise WireError(f"{entry.key}: bytes {entry.offset}..{entry.offset + entry.length} are outside the payload")
        try:
            t = blob.decode(view[entry.offset:entry.offset + entry.length], entry.dtype, entry.shape)
        except blob.BlobError as err:
            raise WireError(f"{entry.key}: {err}") from None
        tensors[entry.key] = t.to(device) if str(device) != "cpu" else t
    return structure.unflatten(index.skeleton, tensors, rebuild)

