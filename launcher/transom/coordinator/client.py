"""Blocking client of the coordinator API, used by workers and the launcher.

Standard library only, so the launcher needs nothing but pydantic. Every call has a
deadline; connection errors and 5xx answers are retried with backoff until it passes
(the coordinator may be restarting), 4xx answers raise `CoordinatorError` at once, except
the quorum long-poll's 408 which means "ask again".

Each thread keeps one connection open to the coordinator (coordinator/keepalive.py): a
leader asks for a quorum every step, and a connection per request costs more than the
request.

The credential a client presents says which replica it speaks for (coordinator/identity.py):
a replica's own identity token, read from `TRANSOM_IDENTITY_TOKEN_FILE` again whenever the
file changes (a projected ServiceAccount token rotates; `transom run` writes a promoted
spare's), or the job's token where no identity file is given (tests, tools).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import TypeVar

from pydantic import BaseModel

from transom.coordinator.keepalive import KeptConnections
from transom.coordinator.models import (
    AsideRequest,
    CheckpointReport,
    FailureReport,
    FenceAnswer,
    FenceRequest,
    FingerprintRecord,
    FinishAnswer,
    FinishRequest,
    HeartbeatRequest,
    Identity,
    IncarnationAnswer,
    JobProgress,
    JobStatus,
    LeaveRequest,
    QuorumRequest,
    QuorumResponse,
    RegisterRequest,
    RegisterResponse,
    RendezvousInfo,
    SignalAnswer,
    SignalBatch,
)
from transom.defaults import CLIENT_QUICK_TIMEOUT_S, CLIENT_REPORT_TIMEOUT_S, CLIENT_TIMEOUT_S, FENCE_LEASE_S
from transom.errors import (  # noqa: F401  (the family lives in errors.py)
    CoordinatorError,
    Evicted,
    Forbidden,
    JobCompleted,
    NotRegistered,
    TooManyRequests,
)

M = TypeVar("M", bound=BaseModel)


def replica_state_path(identity: Identity, known: str | None = None, wait_s: float = 0.0) -> str:
    """GET path of a replica's state; with `known`, a long-poll held until it changes."""
    path = f"/v1/replicas/{identity.replica_id}?generation={identity.generation}&attempt={identity.attempt}"
    return path + (f"&known={known}&wait_s={wait_s:g}" if known is not None else "")


class TokenFile:
    """A bearer token kept in a file, read again when the file changes (by mtime and size)."""

    def __init__(self, path: str):
        self.path = path
        self._seen: tuple[int, int] | None = None
        self._token = ""

    def __call__(self) -> str:
        try:
            st = os.stat(self.path)
            if (st.st_mtime_ns, st.st_size) != self._seen:
                with open(self.path, encoding="ascii", errors="replace") as f:
                    self._token = f.read(16384).strip()
                self._seen = (st.st_mtime_ns, st.st_size)
        except OSError:
            pass  # not there (yet): the last token read, or none; the coordinator answers 401
        return self._token


def credential(identity_token_file: str, token: str) -> str | Callable[[], str]:
    """What a launcher or worker presents: its own identity file if it has one, else `token`."""
    return TokenFile(identity_token_file) if identity_token_file else token


# What the coordinator's web server (aiohttp) answers for a path none of its routes takes: an
# older coordinator without /v1/fence answers this to a fence question.
ROUTE_NOT_FOUND = b"404: Not Found"


def _payload(raw: bytes) -> dict:
    try:
        payload = json.loads(raw or b"{}")
    except ValueError:
        return {}
    return payload if isinstance(payload, dict) else {}


class CoordinatorClient:
    def __init__(self, url: str, token: str | Callable[[], str], timeout_s: float = CLIENT_TIMEOUT_S):
        """`token`: the bearer credential, or a function that returns the current one (TokenFile)."""
        self.url = url.rstrip("/")
        self.credential: Callable[[], str] = token if callable(token) else (lambda: token)
        self.timeout_s = timeout_s
        self._connections = KeptConnections(self.url)

    def _call(
        self,
        method: str,
        path: str,
        body: BaseModel | None = None,
        timeout_s: float | None = None,
        request_timeout_s: float | None = None,
        stopped: Callable[[], bool] | None = None,
    ) -> tuple[int, dict]:
        """`stopped`: the caller's owner is shutting down; give up at the next retry."""
        status, raw = self._request(method, path, body, timeout_s, request_timeout_s, stopped)
        return status, _payload(raw)

    def _request(
        self,
        method: str,
        path: str,
        body: BaseModel | None,
        timeout_s: float | None,
        request_timeout_s: float | None,
        stopped: Callable[[], bool] | None,
    ) -> tuple[int, bytes]:
        """The first answer below 500 as (status, body); 409 raises Evicted."""
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else self.timeout_s)
        data = body.model_dump_json().encode() if body is not None else None
        backoff = 0.05
        while True:
            if stopped is not None and stopped():
                raise CoordinatorError(f"{method} {path}: stopped")
            headers = {"Authorization": f"Bearer {self.credential()}"}
            if data is not None:
                headers["Content-Type"] = "application/json"
            per_try = request_timeout_s or max(0.1, min(10.0, deadline - time.monotonic()))
            try:
                status, reason, raw = self._connections.send(method, path, data, headers, per_try)
            except OSError as e:  # refused, reset, timed out, or no HTTP answer (keepalive.py)
                error: Exception = CoordinatorError(f"{method} {path}: coordinator unreachable: {e}")
            else:
                if status == 409:
                    refused = _payload(raw)
                    raise Evicted(refused.get("error", reason), 409, state=refused.get("state"))
                if status < 500:
                    return status, raw
                error = CoordinatorError(f"{method} {path}: {status} {_payload(raw).get('error', reason)}", status)
            if time.monotonic() + backoff > deadline:
                raise error
            time.sleep(backoff)
            backoff = min(backoff * 2, 1.0)

    def _expect(self, status: int, payload: dict, what: str) -> dict:
        if status == 404 and what in ("heartbeat", "quorum", "leave", "fence"):
            raise NotRegistered(f"{what}: {payload.get('error', 'not registered')}", 404)
        if status == 403:
            raise Forbidden(f"{what}: {payload.get('error', 'forbidden')}")
        if status == 429:
            raise TooManyRequests(f"{what}: {payload.get('error', 'not now')}")
        if status >= 400:
            raise CoordinatorError(f"{what}: {status} {payload.get('error', '')}", status)
        return payload

    def register(self, req: RegisterRequest) -> RegisterResponse:
        status, payload = self._call("POST", "/v1/register", req)
        return RegisterResponse.model_validate(self._expect(status, payload, "register"))

    def heartbeat(self, req: HeartbeatRequest, timeout_s: float = CLIENT_QUICK_TIMEOUT_S) -> None:
        status, payload = self._call("POST", "/v1/heartbeat", req, timeout_s=timeout_s)
        self._expect(status, payload, "heartbeat")

    def report_failure(self, req: FailureReport, timeout_s: float = CLIENT_REPORT_TIMEOUT_S) -> bool:
        status, payload = self._call("POST", "/v1/failure", req, timeout_s=timeout_s)
        return bool(self._expect(status, payload, "failure").get("accepted"))

    def report_checkpoint(self, req: CheckpointReport, timeout_s: float = CLIENT_REPORT_TIMEOUT_S) -> bool:
        """Tell the coordinator a checkpoint is committed; False if an equal or newer one was."""
        status, payload = self._call("POST", "/v1/checkpoint", req, timeout_s=timeout_s)
        return bool(self._expect(status, payload, "checkpoint").get("accepted"))

    def fence(self, req: FenceRequest, timeout_s: float) -> FenceAnswer:
        """May this incarnation act now (write a checkpoint object, serve its state)? Evicted
        (409, with the state the coordinator holds it in) if it is no longer current,
        NotRegistered (404) before it registered again after a coordinator restart. A
        coordinator older than fencing (the operator's image may lag the script's) has no such
        endpoint: the answer then says `supported=False`."""
        status, raw = self._request("POST", "/v1/fence", req, timeout_s, None, None)
        if status == 404 and raw.strip() == ROUTE_NOT_FOUND:
            return FenceAnswer(lease_s=FENCE_LEASE_S, supported=False)
        # Any other 404 (the coordinator's own, or a page from something in between) is no
        # answer: the write waits (fail closed), rather than go ahead unfenced.
        return FenceAnswer.model_validate(self._expect(status, _payload(raw), "fence"))

    def report_signals(self, req: SignalBatch, timeout_s: float = CLIENT_QUICK_TIMEOUT_S) -> SignalAnswer:
        """Post a pod's rows; the answer says how long to wait before the next post, and the
        job's DuplicateData finding if there is one."""
        status, payload = self._call("POST", "/v1/signals", req, timeout_s=timeout_s)
        return SignalAnswer.model_validate(self._expect(status, payload, "signals"))

    def step_aside(self, req: AsideRequest, timeout_s: float = CLIENT_REPORT_TIMEOUT_S) -> None:
        """Tell the coordinator not to wait for this replica until its next quorum request."""
        status, payload = self._call("POST", "/v1/aside", req, timeout_s=timeout_s)
        self._expect(status, payload, "aside")

    def leave(self, req: LeaveRequest, timeout_s: float = CLIENT_REPORT_TIMEOUT_S) -> None:
        status, payload = self._call("POST", "/v1/leave", req, timeout_s=timeout_s)
        self._expect(status, payload, "leave")

    def quorum(self, req: QuorumRequest, timeout_s: float, stopped: Callable[[], bool] | None = None) -> QuorumResponse:
        """Long-poll until this replica's next round is decided, or raise after timeout_s (or
        at the next retry or poll once `stopped()`)."""
        deadline = time.monotonic() + timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise CoordinatorError(f"no quorum within {timeout_s:.0f}s (training paused?)")
            poll = req.model_copy(update={"timeout_s": max(0.1, min(req.timeout_s, remaining))})
            status, raw = self._request("POST", "/v1/quorum", poll, remaining, poll.timeout_s + 5.0, stopped)
            if status == 408:
                continue
            if status == 410:
                raise JobCompleted(_payload(raw).get("error", "job completed"), 410)
            if status == 200:  # every step: validated straight from the bytes
                return QuorumResponse.model_validate_json(raw)
            self._expect(status, _payload(raw), "quorum")
            raise CoordinatorError(f"quorum: unexpected answer {status}", status)

    def replica_state(self, identity: Identity, timeout_s: float = CLIENT_QUICK_TIMEOUT_S) -> IncarnationAnswer:
        status, payload = self._call("GET", replica_state_path(identity), timeout_s=timeout_s)
        return IncarnationAnswer.model_validate(self._expect(status, payload, "replica state"))

    def progress(self, timeout_s: float = CLIENT_REPORT_TIMEOUT_S) -> JobProgress:
        """What a starting replica needs: the newest step of a healthy peer, the newest checkpoint."""
        status, payload = self._call("GET", "/v1/progress", timeout_s=timeout_s)
        return JobProgress.model_validate(self._expect(status, payload, "progress"))

    def fingerprint(self, committed: int, rank: int, timeout_s: float = CLIENT_REPORT_TIMEOUT_S) -> FingerprintRecord:
        """The replicas' record of `rank`'s parameters after `committed` steps."""
        status, payload = self._call("GET", f"/v1/fingerprints/{committed}/{rank}", timeout_s=timeout_s)
        return FingerprintRecord.model_validate(self._expect(status, payload, "fingerprint"))

    def status(self, timeout_s: float = CLIENT_REPORT_TIMEOUT_S) -> JobStatus:
        """The whole job's state (the job's token only)."""
        status, payload = self._call("GET", "/v1/status", timeout_s=timeout_s)
        return JobStatus.model_validate(self._expect(status, payload, "status"))

    def finish(self, step: int, timeout_s: float = CLIENT_REPORT_TIMEOUT_S) -> int:
        """End the job at `step`, or at the earliest step it still can (the job's token only);
        returns the step it will end at. JobCompleted if it already did."""
        status, payload = self._call("POST", "/v1/finish", FinishRequest(step=step), timeout_s=timeout_s)
        if status == 410:
            raise JobCompleted(payload.get("error", "job completed"), 410)
        return FinishAnswer.model_validate(self._expect(status, payload, "finish")).step

    def put_rendezvous(self, info: RendezvousInfo) -> None:
        status, payload = self._call("PUT", "/v1/rendezvous", info)
        self._expect(status, payload, "rendezvous")

    def get_rendezvous(self, identity: Identity, timeout_s: float,
                       stopped: Callable[[], bool] | None = None) -> RendezvousInfo | None:
        """Wait for node 0 of this replica to publish MASTER_ADDR/PORT; None once `stopped()`
        (the launcher got SIGTERM: it must not sit out the whole timeout)."""
        deadline = time.monotonic() + timeout_s
        path = f"/v1/rendezvous/{identity.replica_id}?generation={identity.generation}&attempt={identity.attempt}"
        while True:
            try:  # `_call` checks `stopped` before every try
                status, payload = self._call("GET", path, timeout_s=max(0.1, deadline - time.monotonic()),
                                             stopped=stopped)
            except CoordinatorError:
                if stopped is not None and stopped():
                    return None
                raise
            if status == 200:
                return RendezvousInfo.model_validate(payload)
            if status != 404 or time.monotonic() > deadline:
                raise CoordinatorError(f"rendezvous: {status} {payload.get('error', '')}", status)
            time.sleep(0.2)
