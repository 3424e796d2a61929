"""Copy tensors into host buffers that are reused from one checkpoint to the next.

The copy is the only part of a checkpoint the training loop may have to wait for, and it
only has to be finished before the next `optimizer.step()` changes the parameters in
place. So `start()` returns at once: CUDA tensors are copied on a side stream into pinned
buffers (the stream first waits for the work already queued, so it copies the values of
this step), CPU tensors by a helper thread (torch's copy releases the GIL, so it runs while
the next forward and backward do). `wait()` blocks until the copy is done.

Buffers are kept by key and reused while shape and dtype match, so steady-state
checkpoints allocate nothing; the host memory held is one copy of the state.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

import torch

from transom.cuda_wait import wait_for
from transom.errors import CheckpointError, UsageError


class Snapshot:
    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self._stream: torch.cuda.Stream | None = None
        self._event: torch.cuda.Event | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # wait() is called by the training loop and the persister

    def _buffer(self, key: str, t: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self._buffers[key] = buf
        return buf

    def reserve(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Allocate the buffers for tensors of these shapes now, so that start() allocates
        none. Pinned host memory costs a fraction of a second per 100 MB to allocate (the
        pages are locked), so a caller on the training thread has a helper thread do it."""
        if self.busy:
            raise UsageError("a snapshot copy is in progress; reserve before start()")
        for key, t in tensors.items():
            self._buffer(key, t)

    def start(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Begin copying `tensors` (detached values) into the host buffers."""
        if self._thread is not None or self._event is not None:
            raise UsageError("a snapshot copy is still in progress; wait() for it first")
        for key in [k for k in self._buffers if k not in tensors]:
            del self._buffers[key]
        pairs = [(self._buffer(k, t), t.detach()) for k, t in tensors.items()]
        cuda = [(b, t) for b, t in pairs if t.is_cuda]
        host = [(b, t) for b, t in pairs if not t.is_cuda]
        if cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream()
            self._stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self._stream):
                for b, t in cuda:
                    b.copy_(t, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record(self._stream)
        if host:
            def copy() -> None:
                try:
                    with torch.no_grad():
                        for b, t in host:
                            b.copy_(t)
                except BaseException as e:  # surfaced by wait()
                    self._error = e

            self._thread = threading.Thread(target=copy, name="transom-snapshot-copy", daemon=True)
            self._thread.start()

    def wait(self, timeout_s: float = 300.0) -> dict[str, torch.Tensor]:
        """The host copies, once complete. TimeoutError if the copy takes longer than timeout_s."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            if self._thread is not None:
                self._thread.join(timeout_s)
                if self._thread.is_alive():
                    raise TimeoutError(f"snapshot copy not finished after {timeout_s}s")
                self._thread = None
            if self._event is not None:
                wait_for(self._event, max(0.0, deadline - time.monotonic()), "snapshot copy")
                self._event = None
            if self._error is not None:
                error, self._error = self._error, None
                raise CheckpointError("snapshot copy failed") from error
            return dict(self._buffers)

    @property
    def busy(self) -> bool:
        return self._thread is not None or self._event is not None
