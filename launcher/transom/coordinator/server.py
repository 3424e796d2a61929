"""The coordinator's HTTP API (aiohttp): the calls that change the membership, and the server's
life (its tick, start, stop). The read-mostly routes are lookups.py's, the job owner's (its
status, its end) owner.py's, the door (who may call) access.py's, parsing and error answers
http.py's, the metrics metrics.py's.

All decisions are made by `Membership` (pure logic); this module turns HTTP requests into
calls on it under one asyncio lock and wakes long-polling quorum requests when a round is
decided. Errors a client can cause become 4xx JSON bodies (`{"error": ..., "retry": ...}`);
nothing a client sends reaches an unhandled exception.

Endpoints (bearer token required on everything under /v1/):

    POST /v1/register            RegisterRequest  -> RegisterResponse
    POST /v1/heartbeat           HeartbeatRequest -> {}
    POST /v1/quorum              QuorumRequest    -> QuorumResponse (long-poll; 408 = ask again,
                                                     410 = the job already completed)
    POST /v1/failure             FailureReport    -> {"accepted": bool}
    POST /v1/leave               LeaveRequest     -> {}
    POST /v1/aside               AsideRequest     -> {} (rounds stop waiting for it until it asks again)
    POST /v1/finish              FinishRequest    -> FinishAnswer (the job's token only: the job ends at
                                                     that step; 410 = it already completed)
    POST /v1/fence               FenceRequest     -> FenceAnswer (409: this incarnation may no longer
                                                     act; asked before each checkpoint write: fencing)
    POST /v1/signals             SignalBatch      -> SignalAnswer (verdicts, the pace, the DuplicateData
                                                     finding; 429 = too soon or the detectors' budget is spent)
    GET  /v1/replicas/{id}?generation=G&attempt=A[&known=S&wait_s=W] -> IncarnationAnswer (with
                                                     `known`, a long-poll: answered when the
                                                     state is no longer S, or after W <= 60 s)
    PUT  /v1/rendezvous          RendezvousInfo   -> {}
    GET  /v1/rendezvous/{id}?generation=G&attempt=A -> RendezvousInfo (404 until node 0 put it)
    GET  /v1/progress            -> JobProgress (what a starting replica needs)
    GET  /v1/fingerprints/{step}/{rank} -> FingerprintRecord (a joiner checks its snapshot)
    GET  /v1/status              -> JobStatus (the job token only: it names every replica's incarnation)
    GET  /metrics                Prometheus text (no token: it holds no secrets)
    GET  /healthz                liveness: the event loop answers
    GET  /readyz                 readiness: the round ticker runs and the state is free within 1 s

Who may say what (coordinator/identity.py): every call under /v1/ carries a credential that
names its caller, and a call about another replica than the caller's own is refused (403).
Heartbeats and quorum requests never wait behind detection: a launcher's signal posts are
refused (429, the rows stay with it) when they come faster than its pace or when the
detectors have used their share of the last second (`DETECTION_SHARE`). Every 409 to an
incarnation that is no longer current is counted and told once (coordinator/fencing.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from aiohttp import web

from transom.coordinator import http
from transom.coordinator.access import Access
from transom.coordinator.detection import Detection, SignalGate
from transom.coordinator.fencing import Refusals, refusal_message, told
from transom.coordinator.http import MAX_BODY_BYTES, SUBJECT
from transom.coordinator.identity import ReplicaKeys
from transom.coordinator.kube_status import StatusWriter
from transom.coordinator.lookups import Lookups
from transom.coordinator.membership import Membership, Settings
from transom.coordinator.models import (
    AsideRequest,
    CheckpointReport,
    FailureReport,
    FenceAnswer,
    FenceRequest,
    HeartbeatRequest,
    LeaveRequest,
    QuorumRequest,
    RegisterRequest,
    SignalAnswer,
    SignalBatch,
)
from transom.coordinator.oom_kills import OomKills
from transom.coordinator.owner import OwnerRoutes
from transom.coordinator.shared import Shared
from transom.defaults import COORDINATOR_TICK_S, QUORUM_WAKE_S
from transom.detect.step_rows import DetectionSettings
from transom.errors import EVICTED_STATES, Evicted, JobCompleted
from transom.words import EventKind

if TYPE_CHECKING:
    from transom.coordinator.kube_identity import KubeIdentity

log = logging.getLogger("transom.coordinator")


class CoordinatorServer:
    """One job's coordinator. Owns its tick task; `start`/`stop` bracket its life."""

    def __init__(
        self,
        settings: Settings,
        token: str,
        clock: Callable[[], float] = time.monotonic,
        status_writer: StatusWriter | None = None,
        detection: DetectionSettings | None = None,
        replica_keys: ReplicaKeys | None = None,
        kube_identity: KubeIdentity | None = None,
    ):
        """`token`: the job's (admin) token; `replica_keys`, `kube_identity`: how replicas prove who they are."""
        self.refusals = Refusals()  # 409s to incarnations that are no longer current (fencing.py)
        self.access = Access(token, self.refusals, replica_keys, kube_identity)
        self.settings, self.membership = settings, Membership(settings)
        self.detection = Detection(detection or DetectionSettings(), self.membership)
        self.oom_kills = OomKills()  # the OOMKilled failure reports, for status.training
        self.clock = clock
        self.signal_gate = SignalGate()
        self.lock = asyncio.Lock()
        self._changed = asyncio.Condition(self.lock)
        self._events_seen = 0
        shared = Shared(self.membership, self.detection, self.access, self.refusals, self.signal_gate, self.lock,
                        clock, self.ticking)
        self.lookups, self.owner = Lookups(shared), OwnerRoutes(shared)
        self._runner: web.AppRunner | None = None
        self._tick_task: asyncio.Task | None = None
        self._status_writer = status_writer
        self._status_due = asyncio.Event()  # write status.training now (a completion, a checkpoint, storage trouble)
        self._status_task: asyncio.Task | None = None
        self.port: int | None = None

    # --- application ----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[http.error_middleware(self._refused), self.access.middleware],
                              client_max_size=MAX_BODY_BYTES)
        r = app.router
        r.add_post("/v1/register", self._register)
        r.add_post("/v1/heartbeat", self._heartbeat)
        r.add_post("/v1/quorum", self._quorum)
        r.add_post("/v1/failure", self._failure)
        r.add_post("/v1/leave", self._leave)
        r.add_post("/v1/aside", self._aside)
        r.add_post("/v1/checkpoint", self._checkpoint)
        r.add_post("/v1/fence", self._fence)
        r.add_post("/v1/signals", self._signals)
        self.lookups.add_routes(r)
        self.owner.add_routes(r)
        return app

    # --- handlers ----------------------------------------------------------------------------
    async def _register(self, request: web.Request) -> web.Response:
        req = await http.parse(request, RegisterRequest)
        await self.access.authorize(request, req.identity)
        async with self._changed:
            resp = self.membership.register(req, self.clock())
            self._changed.notify_all()
        return http.ok(resp)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        req = await http.parse(request, HeartbeatRequest)
        await self.access.authorize(request, req.identity)
        async with self.lock:
            if self.membership.heartbeat(req, self.clock()):  # storage trouble began or ended: say it now
                self._status_due.set()
        return http.ok()

    async def _failure(self, request: web.Request) -> web.Response:
        req = await http.parse(request, FailureReport)
        await self.access.authorize(request, req.identity)
        async with self._changed:
            accepted = self.membership.report_failure(req, self.clock())
            self.membership.try_decide(self.clock())
            self._changed.notify_all()
            # Counted also when the replica was already declared failed (its peers' failed
            # step can come first): the kill happened all the same.
            if self.oom_kills.record(req, time.time()):
                self._status_due.set()
        if accepted:
            log.warning("replica %d failed: %s", req.identity.replica_id, req.reason)
        return http.ok({"accepted": accepted})

    async def _leave(self, request: web.Request) -> web.Response:
        req = await http.parse(request, LeaveRequest)
        await self.access.authorize(request, req.identity)
        async with self._changed:
            self.membership.leave(req, self.clock())
            self.membership.try_decide(self.clock())
            self._changed.notify_all()
        if req.completed:
            self._status_due.set()
        return http.ok()

    async def _aside(self, request: web.Request) -> web.Response:
        req = await http.parse(request, AsideRequest)
        await self.access.authorize(request, req.identity)
        async with self._changed:
            self.membership.step_aside(req, self.clock())
            self.detection.step_aside(req.identity.replica_id, req.step)
            self.membership.try_decide(self.clock())  # a round that waited only for it goes on now
            self._changed.notify_all()
        return http.ok()

    async def _checkpoint(self, request: web.Request) -> web.Response:
        req = await http.parse(request, CheckpointReport)
        await self.access.authorize(request, req.identity)
        async with self.lock:
            if accepted := self.membership.record_checkpoint(req, time.time(), self.clock()):
                self._status_due.set()  # status.training.lastCheckpoint now: where a restore would start
        return http.ok({"accepted": accepted})

    async def _fence(self, request: web.Request) -> web.Response:
        """200 while the caller is its replica's current, healthy incarnation; 409 (counted,
        told once) otherwise. Reads only: a question, not a sign of life."""
        req = await http.parse(request, FenceRequest)
        await self.access.authorize(request, req.identity)
        request[SUBJECT] = (req.identity, req.what)
        self.membership.replicas.live(req.identity)  # Evicted or NotRegistered; no await: no lock needed
        return http.ok(FenceAnswer(lease_s=self.settings.heartbeat_timeout_s))

    def _refused(self, request: web.Request, e: Evicted) -> web.Response:
        """The 409 of an incarnation that is no longer current, with what the coordinator holds it
        to be; counted per endpoint, and the first refusal of each incarnation on each endpoint
        becomes an event and a log line (fencing.py)."""
        subject = request.get(SUBJECT)
        if subject is None:
            return http.error(409, str(e), state=e.state)
        identity, what = subject
        known = self.membership.replica_state(identity)
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else request.path
        current = self.membership.replicas.get(identity.replica_id)
        if self.refusals.record(endpoint, identity) and told(identity, current):
            message = refusal_message(identity, endpoint, known, current.identity if current else None, what)
            # No await since the lookup above: no other handler ran in between.
            self.membership.event(self.clock(), EventKind.REFUSED, message, identity.replica_id)
            log.warning("%s", message)
        state = e.state or (known.state if known.state in EVICTED_STATES else None)
        return http.error(409, str(e), state=state)

    async def _signals(self, request: web.Request) -> web.Response:
        principal, now = http.principal(request), self.clock()
        next_post_s = self.detection.post_interval(now)
        if principal.replica_id is not None:  # a replica's post: refused before its body is even read
            self.signal_gate.admit((principal.replica_id, principal.node_rank or 0), next_post_s, now)
        req = await http.parse(request, SignalBatch)
        await self.access.authorize(request, req.identity, node_rank=req.node_rank)
        if principal.replica_id is None:  # the job's token: the body says whose post it is
            self.signal_gate.admit((req.identity.replica_id, req.node_rank), next_post_s, now)
        async with self._changed:
            now = self.clock()
            with self.signal_gate.timed(now):
                verdicts = self.detection.observe(req, now)
            if (found := self.detection.take_duplicate()) is not None:
                log.warning("duplicate data: %s", found.message)
            if verdicts:
                self.membership.try_decide(self.clock())
                self._changed.notify_all()
                self._status_due.set()
        for v in verdicts:
            log.warning("replica %d: %s from step %d: %s", v.replica, v.kind, v.first_step, v.message[:300])
        return http.ok(SignalAnswer(verdicts=len(verdicts), next_post_s=next_post_s,
                                duplicate_data=self.detection.duplicate_data()))

    async def _quorum(self, request: web.Request) -> web.Response:
        req = await http.parse(request, QuorumRequest)
        await self.access.authorize(request, req.identity)
        m = self.membership
        deadline = self.clock() + req.timeout_s
        async with self._changed:
            decision = m.request_quorum(req, self.clock())
            if decision is not None:
                self._changed.notify_all()  # this request may have completed the round
            while decision is None:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    return http.error(408, "no quorum yet; ask again", retry=True)
                try:  # a timeout, not wait_for: that would start a task for every wait of every step
                    async with asyncio.timeout(min(remaining, QUORUM_WAKE_S)):
                        await self._changed.wait()
                except TimeoutError:
                    pass
                m.replicas.live(req.identity)  # raises Evicted if declared dead meanwhile
                decision = m.answer_for(req)
                if decision is None and m.completed_step is not None:
                    raise JobCompleted(f"the job completed at step {m.completed_step}")
            return http.ok(m.response(decision, req.identity.replica_id))

    # --- life cycle ------------------------------------------------------------------------------
    async def _tick(self) -> None:
        """Heartbeat expiry and grace periods advance with time, not only with requests."""
        while True:
            await asyncio.sleep(COORDINATOR_TICK_S)
            async with self._changed:
                now = self.clock()
                before = (self.membership.next_round, self.membership.replicas.healthy_count())
                self.membership.expire(now)
                self.membership.try_decide(now)
                if (self.membership.next_round, self.membership.replicas.healthy_count()) != before:
                    self._changed.notify_all()
                if self.membership.events_total != self._events_seen:
                    self._events_seen = self.membership.events_total
                    self.lookups.states_changed()

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> int:
        # A quorum long-poll can run for up to 120 s; on stop, cancel handlers after 1 s
        # instead of aiohttp's default 60 s wait (which outlasts CoordinatorThread.stop's).
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self._tick_task = asyncio.create_task(self._tick())
        if self._status_writer is not None:
            self._status_task = asyncio.create_task(
                self._status_writer.run(self.training, self._status_due))
        log.info("coordinator for job %s listening on %s:%d", self.settings.job, host, self.port)
        return self.port

    def ticking(self) -> bool:
        """Whether the round ticker runs (started, not stopped, not crashed)."""
        return self._tick_task is not None and not self._tick_task.done()

    def training(self) -> dict:
        """status.training: the membership's progress, the detectors' verdicts, the finding
        that replicas trained on identical inputs."""
        out = self.membership.training(self.clock())
        verdicts = self.detection.status_verdicts()
        if verdicts:
            out["verdicts"] = verdicts
        if (found := self.detection.duplicate_data()) is not None:
            out["duplicateData"] = found.model_dump()
        if oom_kills := self.oom_kills.status():
            out["oomKills"] = oom_kills
        return out

    async def stop(self) -> None:
        for task in (self._tick_task, self._status_task):
            if task is None:
                continue
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                pass
        if self._runner is not None:
            await self._runner.cleanup()
        await self.access.close()
