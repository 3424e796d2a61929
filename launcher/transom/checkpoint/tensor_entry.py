"""One tensor entry, as every format Transom writes or sends names a tensor.

Three formats carry tensors: the state a replica's leader hands to its ranks (ft/wire.py),
the snapshot a source serves to a joiner (ft/transfer.py) and the checkpoint's manifest
(checkpoint/layout.py). Each entry says which tensor (`key`, its place in the state's
skeleton), of what `dtype` (a torch dtype name without "torch.") and `shape`; each format
adds where its bytes lie. The three share this model, so a dtype or a shape that one format
refuses the others refuse too, with the same message, before a byte is allocated. Received
or stored bytes are never unpickled: an entry is data, checked by construction.

torch-free (the operator and `transom` import it without torch; checkpoint/blob.py maps
the names to torch dtypes).
"""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_DIMS = 64
MAX_INT = 1 << 62
# Bytes per element of every dtype an entry may hold (blob.DTYPES maps them to torch).
DTYPE_SIZES: Mapping[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8, "complex128": 16,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
}


class TensorEntry(BaseModel):
    """A tensor's key, dtype and shape; its size follows from them (`size`)."""

    # Read from a peer or from storage: unknown fields, wrong types and coercions are refused.
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    key: str = Field(min_length=1, max_length=4096)
    dtype: str  # e.g. "float32": one of DTYPE_SIZES
    shape: list[int] = Field(max_length=MAX_DIMS)

    @model_validator(mode="after")
    def _known_dtype_and_shape(self) -> TensorEntry:
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"{self.key}: unknown dtype {self.dtype!r}")
        if any(d < 0 or d > MAX_INT for d in self.shape):
            raise ValueError(f"{self.key}: invalid shape {self.shape}")
        return self

    @property
    def size(self) -> int:
        """Bytes of the tensor."""
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n
