"""What a joiner expects its sources' snapshots to hold: the tensors of its own model and optimizer.

A source's manifest (ft/transfer.py) names every tensor it is about to send: key, dtype and
shape. The joiner runs the same script on the same mesh, so it knows each of them from its
own live state before it fetches a byte: it flattens its own model's and optimizer's state
dicts the way a source flattens its snapshot (checkpoint/structure.py, a DTensor as its
local part) and holds the manifest to that (`ExpectedState.mismatch`). A manifest that
names a tensor this replica lacks, lacks one of its model's, or gives one another dtype or
shape is not a state this replica could load, whatever the source's reason, and it is
refused before anything of the size it claims is allocated. Since the tensors lie back to
back (the manifest's own schema checks that), its total is then the model's.

One part cannot be known exactly: an optimizer makes a parameter's state at its first step
(Adam's `step`, `exp_avg`, `exp_avg_sq`), so a joiner that never stepped holds none while
its sources do. For such a parameter the manifest may hold at most `LAZY_ENTRIES` tensors
under `optimizer/state/<i>/` (flat names of at most 64 characters), none with more elements
than the parameter, together at most `LAZY_FACTOR` times its bytes plus one large scalar
per entry. Every torch.optim optimizer a joiner can replay fits (Adam with amsgrad keeps
three tensors of the parameter's size and a scalar step; RMSprop centered with momentum
three; Adafactor smaller ones), as would two float32 moments of a bfloat16 parameter. So
what a source can make a joiner allocate stays a multiple of the model's own size
(`max_total_bytes`), and so does the manifest itself (`max_manifest_bytes`).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import torch

from transom.checkpoint import blob, sharding, structure
from transom.ft.transfer import ALIGN, MAX_CHUNKS, MAX_MANIFEST_BYTES, SnapshotManifest

LAZY_ENTRIES = 8  # optimizer state tensors per parameter that has none here yet
LAZY_FACTOR = 4  # ...holding together at most this many times the parameter's bytes
SCALAR_BYTES = 16  # plus this much per entry: a scalar of the widest dtype (complex128)
_LAZY_KEY = re.compile(r"optimizer/state/(0|[1-9][0-9]{0,8})/[^/]{1,64}")
_LAZY_KEY_CHARS = 100  # the longest key _LAZY_KEY admits, quoted
_ENTRY_CHARS = 160  # a manifest entry's JSON besides its key and shape, and its reference in the skeleton
_DIGEST_CHARS = 11  # "4294967295,"
_SLACK_CHARS = 64 << 10  # hyperparameters and step numbers printed longer than this replica's


@dataclass(frozen=True)
class Spec:
    """A tensor's dtype (the manifest's name for it) and shape."""

    dtype: str
    shape: tuple[int, ...]
    numel: int
    nbytes: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Spec:
        return cls(str(t.dtype).removeprefix("torch."), tuple(t.shape), t.numel(), t.numel() * t.element_size())

    def __str__(self) -> str:
        return f"{self.dtype}{list(self.shape)}"


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class ExpectedState:
    """The tensors a snapshot of this replica's state holds (`tensors`, by flat key) and, for
    each parameter its optimizer holds no state for yet, the parameter (`lazy`, by the
    index the optimizer's state dict gives it)."""

    def __init__(self, tensors: dict[str, Spec], lazy: dict[int, Spec], skeleton_chars: int):
        self.tensors, self.lazy = tensors, lazy
        self.max_total_bytes = (sum(_aligned(s.nbytes) for s in tensors.values())
                                + sum(self._lazy_budget(p) + LAZY_ENTRIES * ALIGN for p in lazy.values()))
        # The manifest is JSON made of the same entries and skeleton: twice this replica's
        # own, the lazy entries at their longest and a digest for every chunk at the
        # smallest chunk size. Read no more than that, so its parsing is bounded too.
        own = skeleton_chars + sum(len(json.dumps(k)) + _ENTRY_CHARS + 21 * len(s.shape) for k, s in tensors.items())
        lazy_chars = len(lazy) * LAZY_ENTRIES * (3 * _LAZY_KEY_CHARS + _ENTRY_CHARS + 21 * blob.MAX_DIMS)
        digests = _DIGEST_CHARS * min(MAX_CHUNKS, self.max_total_bytes)
        self.max_manifest_bytes = min(MAX_MANIFEST_BYTES, 2 * own + lazy_chars + digests + _SLACK_CHARS)

    @classmethod
    def of(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> ExpectedState:
        """From the live objects, as a source's snapshot (catchup.snapshot_part) flattens them.
        Call it on the training thread: it reads the optimizer's state."""
        own = {"step": 0, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        tensors, skeleton = structure.flatten(own, torch.is_tensor, sharding.localize)
        params = [p for g in optimizer.param_groups for p in g["params"]]
        lazy = {i: Spec.of(sharding.localize(p)[0]) for i, p in enumerate(params) if not optimizer.state.get(p)}
        return cls({k: Spec.of(t) for k, t in tensors.items()}, lazy, len(json.dumps(skeleton)))

    def mismatch(self, manifest: SnapshotManifest) -> str | None:
        """Why `manifest` cannot be a snapshot of this replica's state (the first thing found),
        None if it can."""
        lazy_used: dict[int, tuple[int, int]] = {}  # parameter index -> (entries, bytes)
        for e in manifest.entries:
            want = self.tensors.get(e.key)
            if want is not None:
                if e.dtype != want.dtype or tuple(e.shape) != want.shape:
                    return f"{e.key} is {e.dtype}{e.shape} there, {want} here"
                continue
            found = _LAZY_KEY.fullmatch(e.key)
            param = self.lazy.get(int(found.group(1))) if found else None
            if found is None or param is None:
                return f"{e.key[:200]!r}: this replica's model and optimizer hold no such tensor"
            if _numel(e.shape) > max(1, param.numel):
                return f"{e.key} is {e.dtype}{e.shape} there, larger than its parameter {param} here"
            index = int(found.group(1))
            entries, total = lazy_used.get(index, (0, 0))
            entries, total = entries + 1, total + e.size
            if entries > LAZY_ENTRIES or total > self._lazy_budget(param):
                return (f"{e.key}: more optimizer state for its parameter {param} than an optimizer keeps "
                        f"({entries} tensors, {total} bytes)")
            lazy_used[index] = (entries, total)
        keys = {e.key for e in manifest.entries}
        missing = next((k for k in self.tensors if k.startswith("model/") and k not in keys), None)
        if missing is not None:
            return f"{missing} is missing"
        return None

    @staticmethod
    def _lazy_budget(param: Spec) -> int:
        return LAZY_FACTOR * param.nbytes + LAZY_ENTRIES * SCALAR_BYTES


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
