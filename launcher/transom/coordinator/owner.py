"""The job owner's routes, for the job's token only (the operator, `transom run`, an
administrator): the whole job's status, and ending the job at a step. A replica's credential
gets 403 here; the replicas' own routes are server.py's and lookups.py's."""

from __future__ import annotations

import logging

from aiohttp import web

from transom.coordinator import http, job_end
from transom.coordinator.models import FinishAnswer, FinishRequest
from transom.coordinator.shared import Shared

log = logging.getLogger("transom.coordinator")


class OwnerRoutes:
    """The owner's routes of one `CoordinatorServer` (its membership, detection and lock)."""

    def __init__(self, shared: Shared):
        self.shared = shared

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/v1/status", self._status)
        r.add_post("/v1/finish", self._finish)

    async def _status(self, request: web.Request) -> web.Response:
        http.principal(request).require_admin("GET /v1/status")
        s = self.shared
        async with s.lock:
            status = s.membership.status(s.clock())
            return http.ok(status.model_copy(update={"duplicate_data": s.detection.duplicate_data()}))

    async def _finish(self, request: web.Request) -> web.Response:
        """End the job at a step (job_end.py): the round that reaches it tells its members."""
        http.principal(request).require_admin("POST /v1/finish")
        req = await http.parse(request, FinishRequest)
        s = self.shared
        async with s.lock:
            step = job_end.finish(s.membership, req.step, s.clock())
        log.info("the job ends at step %d, as its owner asked", step)
        return http.ok(FinishAnswer(step=step))
