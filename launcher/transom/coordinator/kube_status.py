"""The coordinator's one write to Kubernetes: `status.training` of its TrainingJob.

The Kubernetes API is the only channel between coordinator and operator, and the coordinator
owns exactly `status.training` (the operator owns the rest of status). This writer
merge-patches the status subresource with the job's committed step, last committed
checkpoint and goodput whenever they changed, at most every `interval_s`, with the pod's
ServiceAccount token (the per-job Role allows `patch` on this one job's status and nothing
else). It uses aiohttp, which the coordinator has anyway, instead of the kubernetes client,
so the coordinator image stays small and `transom` keeps importing without it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from transom.coordinator.kube_api import REQUEST_TIMEOUT_S, KubeApi

log = logging.getLogger("transom.coordinator")


@dataclass
class StatusWriter:
    api: KubeApi
    namespace: str
    job: str
    interval_s: float = 5.0

    @property
    def url(self) -> str:
        return self.api.path(f"/apis/transom.io/v1alpha1/namespaces/{self.namespace}/trainingjobs/{self.job}/status")

    async def patch(self, session: aiohttp.ClientSession, training: dict) -> None:
        body = {"status": {"training": training}}
        async with session.patch(self.url, json=body, headers=self.api.headers("application/merge-patch+json"),
                                 timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)) as resp:
            if resp.status >= 300:
                # The body may quote the request; the token is in a header, never in it.
                raise RuntimeError(f"{resp.status} {(await resp.text())[:300]}")

    async def run(self, training: Callable[[], dict], wake: asyncio.Event | None = None) -> None:
        """Write `training()` (status.training without updateTime) whenever it changes; runs until
        cancelled. Setting `wake` makes the next check happen at once rather than after interval_s
        (the operator waits for `completedStep` to call the job done)."""
        wake = wake or asyncio.Event()
        ctx = self.api.ssl_context()
        written: dict | None = None
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=ctx)) as session:
            while True:
                current = training()
                if current != written:
                    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
                    try:
                        await self.patch(session, {**current, "updateTime": now})
                        written = current
                    except Exception as e:  # the API server may be away: training goes on
                        log.warning("could not write status.training of %s/%s: %s", self.namespace, self.job, e)
                try:
                    await asyncio.wait_for(wake.wait(), timeout=self.interval_s)
                except TimeoutError:
                    pass
                wake.clear()
