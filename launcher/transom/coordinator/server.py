"""The coordinator's HTTP API (aiohttp): parsing, auth, long-polling (its metrics: metrics.py).

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
    POST /v1/fence               FenceRequest     -> FenceAnswer (409: this incarnation may no longer
                                                     act; asked before each checkpoint write: fencing)
    POST /v1/signals             SignalBatch      -> SignalAnswer (verdicts, the pace, the DuplicateData
                                                     finding; 429 = too soon or the detectors' budget is spent)
    GET  /v1/replicas/{id}?generation=G&attempt=A[&known=S&wait_s=W] -> ReplicaState (with
                                                     `known`, a long-poll: answered when the
                                                     state is no longer S, or after W <= 60 s)
    PUT  /v1/rendezvous          RendezvousInfo   -> {}
    GET  /v1/rendezvous/{id}?generation=G&attempt=A -> RendezvousInfo (404 until node 0 put it)
    GET  /v1/progress            -> JobProgress (what a starting replica needs)
    GET  /v1/fingerprints/{step}/{rank} -> FingerprintRecord (a joiner checks its snapshot)
    GET  /v1/status              -> JobStatus (the job token only: it names every replica's incarnation)
    GET  /metrics                Prometheus text (no token: it holds no secrets)
    GET  /healthz

Who may say what (coordinator/identity.py): every call under /v1/ carries a credential that
names its caller, and a call about another replica than the caller's own is refused (403).
Heartbeats and quorum requests never wait behind detection: a launcher's signal posts are
refused (429, the rows stay with it) when they come faster than its pace or when the
detectors have used their share of the last second (`DETECTION_SHARE`). Every 409 to an
incarnation that is no longer current is counted and told once (coordinator/fencing.py).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from pydantic import BaseModel, ValidationError

from transom.coordinator.detection import Detection, SignalGate
from transom.coordinator.fencing import ENDPOINTS, Refusals, refusal_message
from transom.coordinator.metrics import MembershipCollector
from transom.coordinator.identity import ADMIN, Principal, ReplicaKeys, is_replica_key
from transom.coordinator.kube_status import StatusWriter
from transom.coordinator.oom_kills import OomKills
from transom.detect.signals import DetectionSettings
from transom.coordinator.membership import Membership, Settings
from transom.errors import (
    EVICTED_STATES,
    CoordinatorError,
    Evicted,
    Forbidden,
    JobCompleted,
    NotRegistered,
    TooManyRequests,
)
from transom.coordinator.models import (
    MAX_STEP,
    AsideRequest,
    CheckpointReport,
    ErrorBody,
    FailureReport,
    FenceAnswer,
    FenceRequest,
    HeartbeatRequest,
    Identity,
    LeaveRequest,
    QuorumRequest,
    RegisterRequest,
    RendezvousInfo,
    SignalAnswer,
    SignalBatch,
)

if TYPE_CHECKING:
    from transom.coordinator.kube_identity import KubeIdentity

log = logging.getLogger("transom.coordinator")
M = TypeVar("M", bound=BaseModel)
TICK_S = 0.05
MAX_STATE_WAIT_S = 60.0  # the longest a replica-state long-poll is held
MAX_BODY_BYTES = 1 << 20


class BadRequest(Exception):
    pass


def _error(status: int, message: str, retry: bool = False, state: str | None = None) -> web.Response:
    body = ErrorBody(error=message, retry=retry, state=state).model_dump_json(exclude_none=True)
    return web.Response(status=status, text=body, content_type="application/json")


def _ok(model: BaseModel | dict | None = None) -> web.Response:
    if isinstance(model, BaseModel):
        return web.Response(text=model.model_dump_json(), content_type="application/json")
    return web.json_response(model or {})


async def _parse(request: web.Request, model: type[M]) -> M:
    try:
        raw = await request.read()
        data = json.loads(raw)
    # ValueError covers JSONDecodeError, UnicodeDecodeError and over-long integer literals;
    # RecursionError is what json raises on deeply nested arrays or objects.
    except (ValueError, RecursionError) as e:
        raise BadRequest(f"body is not valid JSON: {e}") from None
    try:
        return model.model_validate(data)
    except ValidationError as e:
        reasons = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'body'}: {err['msg']}" for err in e.errors())
        raise BadRequest(f"invalid {model.__name__}: {reasons}") from None


def _query_identity(request: web.Request, replica_id: str) -> Identity:
    try:
        return Identity(
            replica_id=int(replica_id),
            generation=int(request.query.get("generation", "0")),
            attempt=int(request.query.get("attempt", "0")),
        )
    except (ValueError, ValidationError) as e:
        raise BadRequest(f"replica id, generation and attempt must be small non-negative integers: {e}") from None


# Where the auth middleware leaves the caller (a typed key where aiohttp has them, 3.12+).
_PRINCIPAL = web.RequestKey("principal", Principal) if hasattr(web, "RequestKey") else "principal"
# The incarnation a call is about, and what it was about to do (/v1/fence): a 409 names them.
_SUBJECT = web.RequestKey("subject", tuple) if hasattr(web, "RequestKey") else "subject"


def _principal(request: web.Request) -> Principal:
    return request[_PRINCIPAL]


class CoordinatorServer:
    """One job's coordinator. Owns its tick task; `start`/`stop` bracket its life."""

    def __init__(
        self,
        settings: Settings,
        token: str,
        clock: Callable[[], float] = time.monotonic,
        status_writer: "StatusWriter | None" = None,
        detection: DetectionSettings | None = None,
        replica_keys: ReplicaKeys | None = None,
        kube_identity: "KubeIdentity | None" = None,
    ):
        """`token`: the job's (admin) token; `replica_keys` and `kube_identity`: how replicas
        prove who they are (coordinator/identity.py, kube_identity.py)."""
        if not token:
            raise ValueError("a coordinator needs a non-empty token")
        self.settings = settings
        self.membership = Membership(settings)
        self.detection = Detection(detection or DetectionSettings(), self.membership)
        self.oom_kills = OomKills()  # the OOMKilled failure reports, for status.training
        self.clock = clock
        self._token = token.encode()
        self._replica_keys = replica_keys
        self._kube_identity = kube_identity
        self.signal_gate = SignalGate()
        self.refusals = Refusals()  # 409s to incarnations that are no longer current (fencing.py)
        self._lock = asyncio.Lock()
        self._changed = asyncio.Condition(self._lock)
        # Replica-state long-polls wait for this event, which the tick sets (and replaces)
        # when membership recorded an event (a registration, failure, leave, completion): not
        # on every quorum round, and without the lock, which 10,000 held polls would queue on.
        self._states_changed = asyncio.Event()
        self._events_seen = 0
        self._rendezvous: dict[tuple[int, int, int], RendezvousInfo] = {}
        self._registry = CollectorRegistry()
        self._registry.register(MembershipCollector(self))
        self._runner: web.AppRunner | None = None
        self._tick_task: asyncio.Task | None = None
        self._status_writer = status_writer
        self._status_due = asyncio.Event()  # write status.training now (the job completed)
        self._status_task: asyncio.Task | None = None
        self.port: int | None = None

    # --- application ----------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._errors, self._auth], client_max_size=MAX_BODY_BYTES)
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
        r.add_get("/v1/replicas/{id}", self._replica)
        r.add_put("/v1/rendezvous", self._put_rendezvous)
        r.add_get("/v1/rendezvous/{id}", self._get_rendezvous)
        r.add_get("/v1/progress", self._progress)
        r.add_get("/v1/fingerprints/{step}/{rank}", self._fingerprint)
        r.add_get("/v1/status", self._status)
        r.add_get("/metrics", self._metrics)
        r.add_get("/healthz", self._healthz)
        return app

    @web.middleware
    async def _errors(self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]):
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status >= 400:
                return _error(e.status, e.reason)
            raise
        except BadRequest as e:
            return _error(400, str(e))
        except ValueError as e:
            return _error(400, str(e))
        except Forbidden as e:
            return _error(403, str(e))
        except TooManyRequests as e:
            return _error(429, str(e), retry=True)
        except Evicted as e:
            return self._refused(request, e)
        except NotRegistered as e:
            return _error(404, str(e))
        except JobCompleted as e:
            return _error(410, str(e))
        except CoordinatorError as e:  # an identity provider that did not answer (TokenReview)
            return _error(503, str(e), retry=True)
        except Exception:  # a bug of ours: answer 500, keep serving every other replica
            log.exception("internal error handling %s %s", request.method, request.path)
            return _error(500, "internal error", retry=True)

    @web.middleware
    async def _auth(self, request: web.Request, handler):
        if request.path.startswith("/v1/"):
            principal = await self._identify(request.headers.get("Authorization", ""))
            if principal is None:
                resource = request.match_info.route.resource
                endpoint = resource.canonical if resource is not None else "other"
                if endpoint in ENDPOINTS:  # a bounded label: other paths are not counted
                    self.refusals.unauthenticated[endpoint] += 1
                return _error(401, "missing or wrong bearer token")
            request[_PRINCIPAL] = principal
        return await handler(request)

    async def _authorize(self, request: web.Request, identity: Identity, node_rank: int | None = None,
                         replica_only: bool = False) -> None:
        """Forbidden unless the caller may speak for `identity` (only its replica, with
        `replica_only`). A pod's labels are read again once before a refusal: a spare the
        operator just relabelled as a replica speaks for it from that moment."""
        principal = _principal(request)
        request[_SUBJECT] = (identity, None)
        check = (lambda p: p.check_replica(identity.replica_id)) if replica_only else \
            (lambda p: p.check(identity, node_rank))
        try:
            check(principal)
        except Forbidden:
            if principal.pod is None or self._kube_identity is None:
                raise
            fresh = await self._kube_identity.refresh(principal)
            if fresh is None:
                raise
            check(fresh)

    async def _identify(self, header: str) -> Principal | None:
        """The caller a bearer credential names, None if it names nobody."""
        scheme, _, presented = header.partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented or len(presented) > 16384:
            return None
        # Header bytes that are not UTF-8 arrive as surrogates: still just a wrong token.
        if hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), self._token):
            return ADMIN
        if self._replica_keys is not None and is_replica_key(presented):
            return self._replica_keys.principal(presented)
        if self._kube_identity is not None and presented.isascii():
            return await self._kube_identity.principal(presented)
        return None

    # --- handlers ----------------------------------------------------------------------------
    async def _register(self, request: web.Request) -> web.Response:
        req = await _parse(request, RegisterRequest)
        await self._authorize(request, req.identity)
        async with self._changed:
            resp = self.membership.register(req, self.clock())
            self._changed.notify_all()
        return _ok(resp)

    async def _heartbeat(self, request: web.Request) -> web.Response:
        req = await _parse(request, HeartbeatRequest)
        await self._authorize(request, req.identity)
        async with self._lock:
            self.membership.heartbeat(req, self.clock())
        return _ok()

    async def _failure(self, request: web.Request) -> web.Response:
        req = await _parse(request, FailureReport)
        await self._authorize(request, req.identity)
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
        return _ok({"accepted": accepted})

    async def _leave(self, request: web.Request) -> web.Response:
        req = await _parse(request, LeaveRequest)
        await self._authorize(request, req.identity)
        async with self._changed:
            self.membership.leave(req, self.clock())
            self.membership.try_decide(self.clock())
            self._changed.notify_all()
        if req.completed:
            self._status_due.set()
        return _ok()

    async def _aside(self, request: web.Request) -> web.Response:
        req = await _parse(request, AsideRequest)
        await self._authorize(request, req.identity)
        async with self._changed:
            self.membership.step_aside(req, self.clock())
            self.detection.step_aside(req.identity.replica_id, req.step)
            self.membership.try_decide(self.clock())  # a round that waited only for it goes on now
            self._changed.notify_all()
        return _ok()

    async def _checkpoint(self, request: web.Request) -> web.Response:
        req = await _parse(request, CheckpointReport)
        await self._authorize(request, req.identity)
        async with self._lock:
            accepted = self.membership.record_checkpoint(req, time.time(), self.clock())
        return _ok({"accepted": accepted})

    async def _fence(self, request: web.Request) -> web.Response:
        """200 while the caller is its replica's current, healthy incarnation; 409 (counted,
        told once) otherwise. Reads only: a question, not a sign of life."""
        req = await _parse(request, FenceRequest)
        await self._authorize(request, req.identity)
        request[_SUBJECT] = (req.identity, req.what)
        self.membership.live(req.identity)  # Evicted or NotRegistered; no await: no lock needed
        return _ok(FenceAnswer(lease_s=self.settings.heartbeat_timeout_s))

    def _refused(self, request: web.Request, e: Evicted) -> web.Response:
        """The 409 of an incarnation that is no longer current, with what the coordinator holds it
        to be; counted per endpoint, and the first refusal of each incarnation on each endpoint
        becomes an event and a log line (fencing.py)."""
        subject = request.get(_SUBJECT)
        if subject is None:
            return _error(409, str(e), state=e.state)
        identity, what = subject
        known = self.membership.replica_state(identity)
        resource = request.match_info.route.resource
        endpoint = resource.canonical if resource is not None else request.path
        if self.refusals.record(endpoint, identity):
            current = self.membership.replicas.get(identity.replica_id)
            message = refusal_message(identity, endpoint, known, current.identity if current else None, what)
            self.membership.event(self.clock(), "refused", message)  # no await since: no handler in between
            log.warning("%s", message)
        state = e.state or (known.state if known.state in EVICTED_STATES else None)
        return _error(409, str(e), state=state)

    async def _signals(self, request: web.Request) -> web.Response:
        principal, now = _principal(request), self.clock()
        next_post_s = self.detection.post_interval(now)
        if principal.replica_id is not None:  # a replica's post: refused before its body is even read
            self.signal_gate.admit((principal.replica_id, principal.node_rank or 0), next_post_s, now)
        req = await _parse(request, SignalBatch)
        await self._authorize(request, req.identity, node_rank=req.node_rank)
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
        return _ok(SignalAnswer(verdicts=len(verdicts), next_post_s=next_post_s,
                                duplicate_data=self.detection.duplicate_data()))

    async def _quorum(self, request: web.Request) -> web.Response:
        req = await _parse(request, QuorumRequest)
        await self._authorize(request, req.identity)
        m = self.membership
        deadline = self.clock() + req.timeout_s
        async with self._changed:
            decision = m.request_quorum(req, self.clock())
            if decision is not None:
                self._changed.notify_all()  # this request may have completed the round
            while decision is None:
                remaining = deadline - self.clock()
                if remaining <= 0:
                    return _error(408, "no quorum yet; ask again", retry=True)
                try:
                    await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))
                except asyncio.TimeoutError:
                    pass
                m.live(req.identity)  # raises Evicted if declared dead meanwhile
                decision = m.answer_for(req)
                if decision is None and m.completed_step is not None:
                    raise JobCompleted(f"the job completed at step {m.completed_step}")
            return _ok(m.response(decision, req.identity.replica_id))

    async def _replica(self, request: web.Request) -> web.Response:
        identity = _query_identity(request, request.match_info["id"])
        await self._authorize(request, identity, replica_only=True)
        known = request.query.get("known")
        try:
            wait_s = float(request.query.get("wait_s", "0"))
        except ValueError:
            raise BadRequest("wait_s must be a number of seconds") from None
        if not 0 <= wait_s <= MAX_STATE_WAIT_S:
            raise BadRequest(f"wait_s must be between 0 and {MAX_STATE_WAIT_S:g}")
        deadline = time.monotonic() + wait_s
        # Reads of membership need no lock: they do not await, so no handler runs in between.
        state = self.membership.replica_state(identity)
        while state.state == known and not state.job_completed and time.monotonic() < deadline:
            changed = self._states_changed
            try:
                async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                    await changed.wait()
            except TimeoutError:
                pass
            state = self.membership.replica_state(identity)
        return _ok(state)

    async def _put_rendezvous(self, request: web.Request) -> web.Response:
        info = await _parse(request, RendezvousInfo)
        await self._authorize(request, info.identity, node_rank=0)  # node 0 publishes the replica's address
        i = info.identity
        async with self._lock:
            self._rendezvous[(i.replica_id, i.generation, i.attempt)] = info
            # Keep only the newest incarnation per replica: the table stays bounded.
            for key in [k for k in self._rendezvous if k[0] == i.replica_id and k[1:] < (i.generation, i.attempt)]:
                del self._rendezvous[key]
        return _ok()

    async def _get_rendezvous(self, request: web.Request) -> web.Response:
        i = _query_identity(request, request.match_info["id"])
        await self._authorize(request, i)
        info = self._rendezvous.get((i.replica_id, i.generation, i.attempt))
        if info is None:
            return _error(404, "node 0 of this replica has not published its address yet", retry=True)
        return _ok(info)

    async def _progress(self, request: web.Request) -> web.Response:
        principal = _principal(request)
        return _ok(self.membership.progress(None if principal.admin else principal.replica_id))

    async def _fingerprint(self, request: web.Request) -> web.Response:
        try:
            step, rank = int(request.match_info["step"]), int(request.match_info["rank"])
        except ValueError:
            raise BadRequest("step and rank must be integers") from None
        if not (0 <= step <= MAX_STEP and 0 <= rank < 1 << 20):
            raise BadRequest("step or rank out of range")
        return _ok(self.detection.fingerprint(step, rank))

    async def _status(self, request: web.Request) -> web.Response:
        _principal(request).require_admin("GET /v1/status")
        async with self._lock:
            status = self.membership.status(self.clock())
            return _ok(status.model_copy(update={"duplicate_data": self.detection.duplicate_data()}))

    async def _metrics(self, request: web.Request) -> web.Response:
        async with self._lock:
            body = generate_latest(self._registry)
        return web.Response(body=body, content_type="text/plain", charset="utf-8")

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    # --- life cycle ------------------------------------------------------------------------------
    async def _tick(self) -> None:
        """Heartbeat expiry and grace periods advance with time, not only with requests."""
        while True:
            await asyncio.sleep(TICK_S)
            async with self._changed:
                now = self.clock()
                before = (self.membership.next_round, self.membership.healthy_count())
                self.membership.expire(now)
                self.membership.try_decide(now)
                if (self.membership.next_round, self.membership.healthy_count()) != before:
                    self._changed.notify_all()
                if self.membership.events_total != self._events_seen:
                    self._events_seen = self.membership.events_total
                    changed, self._states_changed = self._states_changed, asyncio.Event()
                    changed.set()

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
        if self._kube_identity is not None:
            await self._kube_identity.close()


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
            async with self.server._lock:
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
