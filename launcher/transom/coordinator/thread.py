"""A CoordinatorServer on its own event loop thread: how `transom run` (local mode) and the
tests run a coordinator inside another process (server.py re-exports it)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from transom.coordinator.identity import ReplicaKeys
from transom.coordinator.server import CoordinatorServer
from transom.coordinator.settings import Settings
from transom.detect.step_rows import DetectionSettings


class CoordinatorThread:
    """Runs a CoordinatorServer on its own event loop thread (local mode and tests)."""

    def __init__(self, settings: Settings, token: str, host: str = "127.0.0.1", port: int = 0,
                 detection: DetectionSettings | None = None, replica_keys: ReplicaKeys | None = None):
        self.server = CoordinatorServer(settings, token, detection=detection, replica_keys=replica_keys)
        self._host, self._port = host, port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="transom-coordinator", daemon=True)
        self.url = ""

    def start(self, timeout_s: float = 10.0) -> str:
        self._thread.start()
        fut = asyncio.run_coroutine_threadsafe(self.server.start(self._host, self._port), self._loop)
        try:
            port = fut.result(timeout=timeout_s)
        except BaseException:  # no server: its loop thread must not outlive the failed start
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=timeout_s)
            raise
        self.url = f"http://{self._host}:{port}"
        return self.url

    def call(self, fn: Callable[[], object], timeout_s: float = 5.0):
        """Run fn on the coordinator's loop (e.g. to read membership safely)."""

        async def run():
            async with self.server.lock:
                return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(timeout=timeout_s)

    def stop(self, timeout_s: float = 10.0) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(timeout=timeout_s)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=timeout_s)
        if not self._thread.is_alive():  # a loop still running cannot be closed
            self._loop.close()
