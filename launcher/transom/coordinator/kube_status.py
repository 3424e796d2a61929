"""The coordinator's one write to Kubernetes: `status.training` of its TrainingJob.

The Kubernetes API is the only channel between coordinator and operator, and the
coordinator owns exactly `status.training` (the operator owns the rest of status). This
writer merge-patches the status subresource with the job's committed step, last committed
checkpoint and goodput whenever they changed, at most every `interval_s`, with the pod's ServiceAccount token (the per-job Role
allows `patch` on this one job's status and nothing else). It uses aiohttp, which the
coordinator has anyway, instead of the kubernetes client, so the coordinator image stays
small and `transom` keeps importing without it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp

log = logging.getLogger("transom.coordinator")
SA_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass
class StatusWriter:
    api_url: str  # https://host:port of the API server
    namespace: str
    job: str
    token_file: Path  # re-read on every write: projected tokens rotate
    ca_file: Path
    interval_s: float = 5.0

    @classmethod
    def in_cluster(cls, namespace: str, job: str, interval_s: float = 5.0) -> "StatusWriter":
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
        if not host or not port:
            raise ValueError("not running in a Kubernetes pod (KUBERNETES_SERVICE_HOST/PORT unset)")
        host = f"[{host}]" if ":" in host else host
        return cls(f"https://{host}:{port}", namespace, job, SA_DIR / "token", SA_DIR / "ca.crt", interval_s)

    @property
    def url(self) -> str:
        return (f"{self.api_url.rstrip('/')}/apis/transom.io/v1alpha1/namespaces/{self.namespace}"
                f"/trainingjobs/{self.job}/status")

    async def patch(self, session: aiohttp.ClientSession, training: dict) -> None:
        headers = {
            "Authorization": f"Bearer {self.token_file.read_text().strip()}",
            "Content-Type": "application/merge-patch+json",
        }
        body = {"status": {"training": training}}
        async with session.patch(self.url, json=body, headers=headers,
                                 timeout=aiohttp.ClientTimeout(total=10)) as resp:
            if resp.status >= 300:
                # The body may quote the request; the token is in a header, never in it.
                raise RuntimeError(f"{resp.status} {(await resp.text())[:300]}")

    async def run(self, training: Callable[[], dict], wake: asyncio.Event | None = None) -> None:
        """Write `training()` (status.training without updateTime) whenever it changes; runs until
        cancelled. Setting `wake` makes the next check happen at once rather than after interval_s
        (the operator waits for `completedStep` to call the job done)."""
        wake = wake or asyncio.Event()
        ctx = ssl.create_default_context(cafile=str(self.ca_file))
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
                except asyncio.TimeoutError:
                    pass
                wake.clear()
