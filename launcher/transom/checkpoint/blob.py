"""One tensor as a `torch.save` blob: written by torch, read back without unpickling.

DCP's file format stores each tensor as the bytes `torch.save(tensor)` writes: a zip
archive holding a pickle that describes the tensor, and the tensor's raw storage in
`<archive>/data/0`. Loading that with `torch.load` runs an unpickler over bytes that came
from storage or from a peer, and nothing those provide may ever run code here. So `decode`
never looks at the pickle: it finds the storage entry in the archive's directory, checks it
against the dtype and shape that the caller's own record (a JSON manifest) gives, and
copies the raw bytes into a fresh tensor. The archive itself is parsed by `zipfile` (data,
not code), and only plain numeric dtypes are accepted.

Writing goes through torch.save, so `dcp.load` reads what `encode` wrote.
"""

from __future__ import annotations

import ctypes
import io
import struct
import sys
import zipfile
import zlib
from collections.abc import Mapping

import numpy
import torch

from transom.checkpoint.tensor_entry import DTYPE_SIZES, MAX_DIMS
from transom.errors import BlobError  # noqa: F401  (raised here; the family lives in errors.py)

# The dtypes a checkpoint or a peer transfer may carry, by the name the manifest records
# (tensor_entry.DTYPE_SIZES is the one list; an older torch may lack some of them).
DTYPES: Mapping[str, torch.dtype] = {name: getattr(torch, name) for name in DTYPE_SIZES if hasattr(torch, name)}
_LOCAL_HEADER = struct.Struct("<IHHHHHIIIHH")  # zip local file header, 30 bytes
_LOCAL_MAGIC = 0x04034B50


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest's name of `dtype`; TypeError for a dtype that cannot be stored."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise TypeError(f"a {dtype} tensor cannot be checkpointed (supported: {', '.join(DTYPES)})")
    return name


def nbytes_of(dtype: str, shape: list[int]) -> int:
    """Bytes of a tensor of `dtype` (a manifest name) and `shape`; BlobError if invalid."""
    if dtype not in DTYPES:
        raise BlobError(f"unknown dtype {dtype!r}")
    if len(shape) > MAX_DIMS or any(not isinstance(d, int) or isinstance(d, bool) or d < 0 for d in shape):
        raise BlobError(f"invalid shape {shape!r}")
    n = DTYPES[dtype].itemsize
    for d in shape:
        n *= d
    return n


def crc32(t: torch.Tensor) -> int:
    """CRC-32 of a CPU tensor's bytes (zlib releases the GIL on large buffers)."""
    flat = t.detach().contiguous().reshape(-1)
    if flat.numel() == 0:
        return 0
    return zlib.crc32(flat.view(torch.uint8).numpy().data)


def write(t: torch.Tensor, stream) -> None:
    """torch.save `t` (a CPU tensor) to `stream`, with a storage of exactly its own bytes."""
    dtype_name(t.dtype)
    if not t.is_contiguous() or t.untyped_storage().nbytes() != t.numel() * t.element_size() \
            or t.storage_offset() != 0:
        t = t.clone(memory_format=torch.contiguous_format)  # torch.save writes the whole storage
    torch.save(t, stream)


def encode(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    write(t, buf)
    return buf.getvalue()


def decode(blob: bytes | bytearray | memoryview, dtype: str, shape: list[int], copy: bool = True) -> torch.Tensor:
    """The tensor of `dtype` and `shape` stored in `blob`; BlobError if the blob disagrees.
    `copy=False`: a view of `blob`'s bytes where they are aligned for `dtype` (a writable
    buffer that outlives nothing: the tensor keeps it alive), else a copy.

    Nothing in `blob` is executed: the archive's pickle is never read.
    """
    if sys.byteorder != "little":
        raise BlobError("checkpoints are little-endian; this machine is not")
    expected = nbytes_of(dtype, shape)
    view = memoryview(blob).cast("B")
    try:
        with zipfile.ZipFile(_Reader(view)) as archive:
            infos = archive.infolist()
            storages = [i for i in infos if i.filename.rsplit("/", 2)[-2:-1] == ["data"]]
            order = [i for i in infos if i.filename.endswith("/byteorder")]
            if order and archive.read(order[0]).strip() != b"little":
                raise BlobError("the blob is not little-endian")
    except BlobError:
        raise
    except Exception as e:  # noqa: BLE001 - zipfile on hostile bytes raises many kinds; all mean "not ours"
        raise BlobError(f"not a tensor archive: {type(e).__name__}: {e}") from None
    if len(storages) != 1:
        raise BlobError(f"expected one storage in the archive, found {len(storages)}")
    info = storages[0]
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != info.compress_size:
        raise BlobError("the tensor's storage is compressed")
    if info.file_size != expected:
        raise BlobError(f"the storage holds {info.file_size} bytes, {dtype}{shape} needs {expected}")
    start = _data_start(view, info)
    itemsize = torch.empty((), dtype=DTYPES[dtype]).element_size()
    if not copy and expected and not view.readonly and _address(view, start) % itemsize == 0:
        flat = torch.frombuffer(view, dtype=torch.uint8, count=expected, offset=start)
        return flat.view(DTYPES[dtype]).reshape(shape)
    out = torch.empty(shape, dtype=DTYPES[dtype])
    if expected:
        out.reshape(-1).view(torch.uint8).numpy()[:] = numpy.frombuffer(view, numpy.uint8, expected, start)
    return out


def _address(view: memoryview, offset: int) -> int:
    """The memory address of `view[offset]` (alignment of a zero-copy tensor)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view, offset))


def _data_start(view: memoryview, info: zipfile.ZipInfo) -> int:
    """Where an entry's bytes begin: after its local header, name and extra field."""
    header = bytes(view[info.header_offset:info.header_offset + _LOCAL_HEADER.size])
    if len(header) != _LOCAL_HEADER.size:
        raise BlobError("truncated archive")
    fields = _LOCAL_HEADER.unpack(header)
    if fields[0] != _LOCAL_MAGIC:
        raise BlobError("bad local header in the archive")
    start = info.header_offset + _LOCAL_HEADER.size + fields[9] + fields[10]
    if start + info.file_size > len(view):
        raise BlobError("the archive ends inside the tensor's storage")
    return start


class _Reader(io.RawIOBase):
    """A seekable read-only file over a memoryview, so zipfile reads the archive in place."""

    def __init__(self, view: memoryview):
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer) -> int:
        chunk = self._view[self._pos:self._pos + len(buffer)]
        buffer[:len(chunk)] = chunk
        self._pos += len(chunk)
        return len(chunk)
