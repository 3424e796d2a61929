"""`CoordinatorLink`: what a replica's leader (its rank 0) says to the coordinator, and hears.

The leader registers the replica, heartbeats in a thread of its own, asks for every step's
quorum from a thread of its own (the request leaves when the step begins and overlaps the
forward pass; requests go one after another), and reports checkpoints, failures and its
leaving. The other ranks of the replica never talk to the coordinator: the trainer hands
them the leader's answers over the replica's control group (`hand_outcome`). What the
coordinator says of the incarnation reaches its fence (ft/fencing.py): a registration or a
heartbeat answered vouches for it, a 409 fences it.

Every thread here is stopped by `close()`, also one in the middle of a quorum request to an
unreachable coordinator (which would otherwise retry until `quorum_timeout_s`): the request
gives up at its next retry, and its thread is a daemon, so that a long-poll still on the
wire never holds the process's exit.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import logging
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch.distributed as dist

from transom.coordinator.client import CoordinatorClient, CoordinatorError, Evicted, JobCompleted, NotRegistered
from transom.coordinator.models import (
    AsideRequest,
    CheckpointReport,
    FailureReport,
    HeartbeatRequest,
    Identity,
    LeaveRequest,
    QuorumRequest,
    QuorumResponse,
    RegisterRequest,
)
from transom.ft import peer_loss
from transom.ft.config import FTConfig
from transom.ft.fencing import IncarnationFence
from transom.ft.replica import ReplicaContext

log = logging.getLogger("transom.ft")
COMPLETION_ROUND_S = 180.0  # the most close() waits for the round a completion needs


class CoordinatorLink:
    def __init__(self, client: CoordinatorClient, registration: RegisterRequest, quorum_timeout_s: float,
                 progress: Callable[[], int], fence: IncarnationFence | None = None,
                 trouble: Callable[[], str | None] = lambda: None):
        """Register now and start heartbeating; `progress()` is the committed step a beat
        reports, `trouble()` what the replica's checkpoint writer fails at (None: nothing)."""
        self.client, self.registration = client, registration
        self._trouble = trouble
        self.identity: Identity = registration.identity
        self.quorum_timeout_s = quorum_timeout_s
        self.evicted: str | None = None  # set by the heartbeat thread when the coordinator evicts us
        self._progress = progress
        self._fence = fence
        sent = time.monotonic()
        reg = client.register(registration)
        if fence is not None:
            fence.vouch(sent, reg.heartbeat_timeout_s)
        self._stop = threading.Event()
        # A request without a QuorumRequest is close()'s: the asker stops.
        self._requests: queue.SimpleQueue[tuple[QuorumRequest | None, concurrent.futures.Future]] = queue.SimpleQueue()
        self._asker = threading.Thread(target=self._ask_loop, name="transom-quorum", daemon=True)
        self._asker.start()
        self._heartbeat = threading.Thread(target=self._heartbeat_loop, args=(reg.heartbeat_interval_s,),
                                           name="transom-heartbeat", daemon=True)
        self._heartbeat.start()

    def ask(self, req: QuorumRequest) -> concurrent.futures.Future:
        """The quorum of the step `req` describes, answered in the background."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._stop.is_set():
            future.set_exception(CoordinatorError("the replica's coordinator link is closed"))
        else:
            self._requests.put((req, future))
        return future

    def _ask_loop(self) -> None:
        while not self._stop.is_set():
            try:
                req, future = self._requests.get(timeout=0.5)
            except queue.Empty:
                continue
            if req is None:  # close(): wake up and go
                return
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(self._quorum_call(req))
                except BaseException as e:  # the future carries it to the step that waits
                    future.set_exception(e)

    def _quorum_call(self, req: QuorumRequest) -> QuorumResponse:
        stopped = self._stop.is_set
        # The share schedule a replica holds matters only to a restarted coordinator's first
        # round, which every request reaches with last_round -1 (below); the others leave it
        # out (a 250-replica job's vector would be 3 KB a step from every leader).
        lean = req if req.last_round < 0 else req.model_copy(update={"shares_held": None, "shares_held_from": 0})
        try:
            return self.client.quorum(lean, self.quorum_timeout_s, stopped=stopped)
        except NotRegistered:
            # The coordinator restarted and lost its memory: introduce ourselves again; the
            # new coordinator's first round gathers everyone at the steps they hold.
            log.warning("replica %d: coordinator does not know us (restarted?); registering again",
                        self.identity.replica_id)
            self.client.register(self.registration.model_copy(update={"step": req.step}))
            return self.client.quorum(req.model_copy(update={"last_round": -1}), self.quorum_timeout_s,
                                      stopped=stopped)

    def take_one_round(self, step: int, commit_quorum_id: int) -> None:
        """Be answered by one round before completing the job: the coordinator takes a
        completion only from a replica a round answered (claims.py), and a replica that
        restored the job's target step trains no step. Never raises: a completion it then
        refuses is the launcher's to see."""
        req = QuorumRequest(identity=self.identity, step=step, commit_quorum_id=commit_quorum_id, last_round=-1)
        try:  # a first round waits for every replica up to the coordinator's startup wait (60 s)
            self.ask(req).result(timeout=min(self.quorum_timeout_s, COMPLETION_ROUND_S))
        except Exception as e:
            log.warning("replica %d: no round before completing the job: %s", self.identity.replica_id, e)

    def step_aside(self, step: int) -> None:
        """Rounds stop waiting for this replica until it asks for its next quorum
        (trainer.aside()). Raises what the coordinator answers: a replica that stays on
        the rounds' list unannounced would be taken for hung."""
        self.client.step_aside(AsideRequest(identity=self.identity, step=step))

    def report_checkpoint(self, step: int, uri: str, stall_s: float | None) -> None:
        self.client.report_checkpoint(CheckpointReport(identity=self.identity, step=step, uri=uri,
                                                       stall_seconds=stall_s))

    def close(self, leave: LeaveRequest | None) -> None:
        """Stop the heartbeat and the quorum thread; `leave`: say goodbye first (never raises).
        A request not yet sent is cancelled; one in flight ends at its next retry or poll."""
        self._stop.set()
        self._requests.put((None, concurrent.futures.Future()))  # the asker waits for a request: this one
        self._heartbeat.join(timeout=5)
        self._asker.join(timeout=1)  # a long-poll on the wire may outlast this: a daemon
        while True:
            try:
                _, future = self._requests.get_nowait()
            except queue.Empty:
                break
            future.cancel()
        if leave is not None:
            try:
                self.client.leave(leave)
            except Exception as e:
                log.warning("could not tell the coordinator that replica %d left: %s", self.identity.replica_id, e)

    def _heartbeat_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                sent = time.monotonic()
                beat = HeartbeatRequest(identity=self.identity, step=self._progress(),
                                        checkpoint_trouble=_printable(self._trouble()))
                self.client.heartbeat(beat, timeout_s=interval_s)
                if self._fence is not None:
                    self._fence.vouch(sent)
            except Evicted as e:
                if self._fence is not None:
                    self._fence.learn(e.state)
                self.evicted = str(e)
                log.error("replica %d evicted by the coordinator: %s", self.identity.replica_id, e)
                return
            except NotRegistered:
                pass  # the quorum request registers again; heartbeats resume after that
            except Exception as e:  # coordinator briefly unreachable: keep trying
                log.warning("heartbeat of replica %d failed: %s", self.identity.replica_id, e)


def _printable(text: str | None, limit: int = 300) -> str | None:
    """`text` as a heartbeat may carry it (printable ASCII, at most `limit` characters): a
    beat the coordinator refuses would count as a missed one."""
    if not text:
        return None
    kept = "".join(c if " " <= c <= "~" else "?" for c in text)[:limit]
    return kept or None


def register(ctx: ReplicaContext, client: CoordinatorClient, identity: Identity, config: FTConfig,
             fence: IncarnationFence, endpoints: list[str], progress: Callable[[], int],
             trouble: Callable[[], str | None] = lambda: None,
             ) -> tuple[dist.TCPStore | None, CoordinatorLink | None]:
    """The leader's store and its link to the coordinator, registered at step `progress()`
    with every rank's state endpoint (None, None on the other ranks); its heartbeats say
    `trouble()` (what the replica's checkpoint writers fail at: ft/trouble_board.py)."""
    if not ctx.is_leader:
        return None, None
    env = ctx.env
    # This replica's store: the coordinator points a quorum at one member's store.
    store = dist.TCPStore(ctx.bind_host, 0, is_master=True, wait_for_workers=False, use_libuv=True,
                          timeout=datetime.timedelta(seconds=config.collective_timeout_s))
    registration = RegisterRequest(identity=identity, state_endpoints=endpoints, step=progress(),
                                   store_addr=f"{env.advertise_addr}:{store.port}")
    return store, CoordinatorLink(client, registration, config.quorum_timeout_s, progress, fence, trouble)


def leave_request(identity: Identity, step: int, num_steps: int | None, completed: bool, completed_elsewhere: bool,
                  end_job: bool) -> LeaveRequest | None:
    """What the leader says as the replica leaves: a completion, or that it saw the job
    completed elsewhere, and why; None for a failure (reported on its own)."""
    if not (completed or completed_elsewhere):
        return None
    reason = "job completed elsewhere" if completed_elsewhere else \
        "ended the job" if end_job and step < (num_steps or 0) else "completed"
    return LeaveRequest(identity=identity, step=step, completed=completed, reason=reason)


def coordinator_view(client: CoordinatorClient, replica_id: int) -> tuple[int | None, int | None]:
    """(the newest step a healthy peer reported, the newest checkpoint the coordinator
    recorded committed); None for what is unknown."""
    try:
        progress = client.progress(timeout_s=5.0)
    except Exception as e:  # no answer: restore, which is always correct
        log.warning("replica %d: coordinator progress unavailable (%s); restoring the checkpoint", replica_id, e)
        return None, None
    return progress.peer_step, progress.last_checkpoint


def close_failure_reason(step: int, num_steps: int | None) -> str:
    """Why a close() before the job's target is this replica's failure."""
    target = "no target (steps() was not used)" if num_steps is None else f"the target {num_steps}"
    exc = sys.exc_info()[1]  # close() in a `finally:` while an exception propagates
    cause = f": {type(exc).__name__}: {exc}" if exc is not None else ""
    return f"closed at step {step}, before {target}{cause}"[:1000]


def report_close_failure(client: CoordinatorClient, identity: Identity, step: int, num_steps: int | None) -> None:
    """close() before the target: log it and report this replica failed (the leader talks for it)."""
    reason = close_failure_reason(step, num_steps)
    log.error("replica %d %s", identity.replica_id, reason)
    report_failure(client, identity, reason, timeout_s=2.0, exc=sys.exc_info()[1])


def report_failure(client: CoordinatorClient, identity: Identity, reason: str, timeout_s: float,
                   exc: BaseException | None = None) -> None:
    """Tell the coordinator this replica failed (any rank may), by `exc` if given; never
    raises: the launcher reports the exit too. If `exc` only echoes a peer process's death,
    the report waits and says so (ft/peer_loss.py): the launcher reports the death first."""
    reason, wait_s = peer_loss.echo_report(reason, exc)
    if wait_s > 0:
        log.warning("replica %d: a peer process of the replica went away; reporting in %.1fs unless its launcher "
                    "reports first", identity.replica_id, wait_s)
        time.sleep(wait_s)
    try:
        client.report_failure(FailureReport(identity=identity, reason=reason[:1000]), timeout_s=timeout_s)
    except Exception as e:
        log.warning("could not report replica %d failed: %s", identity.replica_id, e)


# The leader tells its replica's other ranks at least this often that it is still waiting
# for the quorum, far below the control group's timeout (replica.init's timeout_s, 300 s by
# default): a pause below minReplicas lasts up to quorum_timeout_s (900 s), and the other
# ranks' wait on the control group must not end first.
STILL_WAITING_EVERY_S = 60.0
STILL_WAITING = {"waiting": "no quorum yet"}


def hand_outcome(from_leader: Callable[[Any], Any], future: concurrent.futures.Future | None, timeout_s: float,
                 every_s: float = STILL_WAITING_EVERY_S) -> str | dict:
    """The quorum's outcome (`outcome`) on every rank of the replica: the leader (the rank with
    the `future`) waits up to `timeout_s` for it, and hands the others STILL_WAITING every
    `every_s` until then; `from_leader` is the replica's broadcast from its rank 0."""
    deadline = time.monotonic() + timeout_s
    while True:
        payload: str | dict | None = None
        if future is not None:
            remaining = deadline - time.monotonic()
            if remaining > every_s:
                done, _ = concurrent.futures.wait([future], timeout=every_s)
                payload = outcome(future, 0) if done else STILL_WAITING
            else:
                payload = outcome(future, max(0.0, remaining))
        answer = from_leader(payload)
        if answer != STILL_WAITING:
            return answer


def outcome(future: concurrent.futures.Future, timeout_s: float) -> str | dict:
    """A quorum request's outcome as the leader hands it to its replica's other ranks: the
    answer's JSON, or {"evicted" | "completed" | "error": message} (an eviction with the
    state the coordinator holds the incarnation in)."""
    try:
        return future.result(timeout=timeout_s).model_dump_json()
    except Evicted as e:
        return {"evicted": str(e), "state": e.state}
    except JobCompleted as e:
        return {"completed": str(e)}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


NoAnswerKind = Literal["evicted", "completed", "error"]


@dataclass(frozen=True)
class NoQuorumAnswer:
    """A quorum request that brought no quorum, and why: the coordinator evicted this
    incarnation (with the state it holds it in), the job completed without it, or the
    request failed."""

    kind: NoAnswerKind
    message: str
    state: str | None = None


def read_outcome(payload: str | dict) -> QuorumResponse | NoQuorumAnswer:
    """`outcome`'s payload, as every rank received it, typed again."""
    if isinstance(payload, str):
        return QuorumResponse.model_validate_json(payload)
    kinds: tuple[NoAnswerKind, ...] = ("evicted", "completed", "error")
    kind = next(k for k in kinds if k in payload)
    return NoQuorumAnswer(kind=kind, message=payload[kind], state=payload.get("state"))
