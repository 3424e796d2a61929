"""The coordinator's read-mostly routes: what a replica looks up rather than reports — the
state of an incarnation (a long-poll), node 0's rendezvous address, a starting replica's
progress, a fingerprint — and the probes and metrics. The calls that change the membership
are server.py's, the job owner's (its status, its end) owner.py's; these only read it (and
the rendezvous table they keep)."""

from __future__ import annotations

import asyncio
import time

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest

from transom.coordinator import http
from transom.coordinator.http import BadRequest
from transom.coordinator.metrics import MembershipCollector
from transom.coordinator.models import MAX_STEP, RendezvousInfo
from transom.coordinator.shared import Shared
from transom.defaults import MAX_STATE_WAIT_S

MAX_RANK = 1 << 20  # ranks a fingerprint may be asked for
READY_LOCK_S = 1.0  # /readyz: longer than this waiting for the state, and the coordinator is not ready


class Lookups:
    """The read-mostly routes of one `CoordinatorServer` (its membership, detection and lock)."""

    def __init__(self, shared: Shared):
        self.shared = shared
        # Replica-state long-polls wait for this event, which `states_changed` sets (and
        # replaces) when membership recorded an event (a registration, failure, leave,
        # completion): not on every quorum round, and without the lock, which 10,000 held
        # polls would queue on.
        self._states_changed = asyncio.Event()
        self._rendezvous: dict[tuple[int, int, int], RendezvousInfo] = {}
        self.registry = CollectorRegistry()
        self.registry.register(MembershipCollector(shared))

    def add_routes(self, r: web.UrlDispatcher) -> None:
        r.add_get("/v1/replicas/{id}", self._replica)
        r.add_put("/v1/rendezvous", self._put_rendezvous)
        r.add_get("/v1/rendezvous/{id}", self._get_rendezvous)
        r.add_get("/v1/progress", self._progress)
        r.add_get("/v1/fingerprints/{step}/{rank}", self._fingerprint)
        r.add_get("/metrics", self._metrics)
        r.add_get("/healthz", self._healthz)
        r.add_get("/readyz", self._readyz)

    def states_changed(self) -> None:
        """Wake the replica-state long-polls: some incarnation's state may have changed."""
        changed, self._states_changed = self._states_changed, asyncio.Event()
        changed.set()

    async def _replica(self, request: web.Request) -> web.Response:
        identity = http.query_identity(request, request.match_info["id"])
        await self.shared.access.authorize(request, identity, replica_only=True)
        known = request.query.get("known")
        try:
            wait_s = float(request.query.get("wait_s", "0"))
        except ValueError:
            raise BadRequest("wait_s must be a number of seconds") from None
        if not 0 <= wait_s <= MAX_STATE_WAIT_S:
            raise BadRequest(f"wait_s must be between 0 and {MAX_STATE_WAIT_S:g}")
        deadline = time.monotonic() + wait_s
        # Reads of membership need no lock: they do not await, so no handler runs in between.
        membership = self.shared.membership
        state = membership.replica_state(identity)
        while state.state == known and not state.job_completed and time.monotonic() < deadline:
            changed = self._states_changed
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await changed.wait()
            except TimeoutError:
                pass
            state = membership.replica_state(identity)
        return http.ok(state)

    async def _put_rendezvous(self, request: web.Request) -> web.Response:
        info = await http.parse(request, RendezvousInfo)
        await self.shared.access.authorize(request, info.identity, node_rank=0)  # node 0 publishes the address
        i = info.identity
        async with self.shared.lock:
            self._rendezvous[(i.replica_id, i.generation, i.attempt)] = info
            # Keep only the newest incarnation per replica: the table stays bounded.
            for key in [k for k in self._rendezvous if k[0] == i.replica_id and k[1:] < (i.generation, i.attempt)]:
                del self._rendezvous[key]
        return http.ok()

    async def _get_rendezvous(self, request: web.Request) -> web.Response:
        i = http.query_identity(request, request.match_info["id"])
        await self.shared.access.authorize(request, i)
        info = self._rendezvous.get((i.replica_id, i.generation, i.attempt))
        if info is None:
            return http.error(404, "node 0 of this replica has not published its address yet", retry=True)
        return http.ok(info)

    async def _progress(self, request: web.Request) -> web.Response:
        principal = http.principal(request)
        return http.ok(self.shared.membership.progress(None if principal.admin else principal.replica_id))

    async def _fingerprint(self, request: web.Request) -> web.Response:
        try:
            step, rank = int(request.match_info["step"]), int(request.match_info["rank"])
        except ValueError:
            raise BadRequest("step and rank must be integers") from None
        if not (0 <= step <= MAX_STEP and 0 <= rank < MAX_RANK):
            raise BadRequest("step or rank out of range")
        return http.ok(self.shared.detection.fingerprint(step, rank))

    async def _metrics(self, request: web.Request) -> web.Response:
        async with self.shared.lock:
            body = generate_latest(self.registry)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def _healthz(self, request: web.Request) -> web.Response:
        """Liveness: the event loop answers (the kubelet restarts a coordinator that does not)."""
        return web.Response(text="ok")

    async def _readyz(self, request: web.Request) -> web.Response:
        """Readiness: the coordinator can do its work now, its round ticker running and its
        state free within READY_LOCK_S; otherwise 503 with why (the Service stops sending
        it calls it would only queue, and `kubectl describe` says so)."""
        if not self.shared.ticking():
            return web.Response(status=503, text="the round ticker is not running")
        try:
            async with asyncio.timeout(READY_LOCK_S):
                await self.shared.lock.acquire()
        except TimeoutError:
            return web.Response(status=503, text=f"the coordinator's state stayed busy for {READY_LOCK_S:g} s")
        self.shared.lock.release()
        return web.Response(text="ready")
