"""Fencing: an incarnation that is no longer current writes nothing and serves nothing.

A replica's incarnation can outlive its place in the job. A node cut off from the network,
or a process stopped (SIGSTOP, a paused VM, a long stall in the kernel), for longer than the
heartbeat timeout is declared failed; its replacement registers as the next generation and
joins; then the old incarnation comes back: a *zombie*. The coordinator answers all its calls
409, so it joins no round and commits no step (its quorum request is refused, and the step's
update is discarded). But some of a worker's threads ask the coordinator nothing: the
checkpoint engine writes parts, records, the manifest and deletes old steps straight to
storage, and the state server serves whoever holds the job's peer token. A zombie that
writes a checkpoint part after it was replaced can have it committed into a checkpoint, and
one that prunes can delete a step that is being written: data loss.

`IncarnationFence` closes that. Before each checkpoint object it writes or deletes, a process
asks the coordinator (`POST /v1/fence`, the same liveness rule as every other call):

- the replica's current, healthy incarnation: go ahead;
- superseded, failed or left (409): `Fenced` is raised, nothing is written, one line says
  so ("fenced: replica 1 generation 0 attempt 0 was superseded; checkpoint part 1 of step 10
  not written"), and the incarnation stays fenced for good;
- no answer (the coordinator away or restarting, 404 until the leader registered again):
  *not confirmed*, nothing is written; the checkpoint engine retries it like a storage error
  (backing off up to 30 s) until the coordinator answers or the engine closes. Skipping the
  checkpoint instead would lose one to every blip of the coordinator, and waiting costs
  nothing: checkpoints due meanwhile are skipped anyway, so memory stays bounded.
- An answer that came back more than `timeout_s` after the question is not trusted: the
  process may have been stopped while it travelled. It is asked again later.

A fenced incarnation still asks (so that the coordinator counts what it tried), but is
refused whatever the answer. The cost is one small request per object (a part's data file
and record; the commit's index and manifest; each step pruned), not per byte.

The state server serves only while this process was vouched for within the lease (the
coordinator's heartbeat timeout): by the leader's heartbeats, or by a confirmation that it
asks for itself, one at a time, at most once a second after a failed one. Once fenced, it
serves nothing.

What a question before a write cannot do: a process stopped after the coordinator's answer
and before the write's first byte (a few microseconds) writes that one object when it wakes;
a data file whose writing was stopped midway is completed, but its part never gets the
record that makes it part of a commit. Only storage that checks a token on every write
could close that.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Literal

from transom.coordinator.client import CoordinatorClient
from transom.coordinator.models import FenceRequest, Identity
from transom.defaults import FENCE_LEASE_S, FENCE_TIMEOUT_S
from transom.errors import CoordinatorError, Evicted, Fenced

log = logging.getLogger("transom.ft")
PAST = {"write": "written", "delete": "deleted", "serve": "served"}
WAS = {"superseded": "was superseded", "failed": "was declared failed", "left": "had left"}
RETRY_SERVE_S = 1.0  # after a failed confirmation, the state server refuses without asking for this long
FenceAnswer = Literal["go", "fenced", "unconfirmed"]


def fenced_line(identity: Identity, state: str, consequence: str) -> str:
    """The one line a refused effect logs: "fenced: replica 1 generation 0 attempt 0 was
    superseded; checkpoint part 1 of step 10 not written" (or "was declared failed", "had left")."""
    return (f"fenced: replica {identity.replica_id} generation {identity.generation} attempt {identity.attempt} "
            f"{WAS.get(state, 'was ' + state)}; {consequence}")


def verdict(fenced: str | None, answer: Literal["current", "refused", "none"], elapsed_s: float,
            timeout_s: float) -> FenceAnswer:
    """Whether an effect may go ahead: `answer` is the coordinator's ("none": no answer),
    `elapsed_s` how long it took to come back, `fenced` what this incarnation already knew."""
    if fenced is not None or answer == "refused":
        return "fenced"
    if answer == "none" or elapsed_s > timeout_s:  # a late answer may be from before a long stop
        return "unconfirmed"
    return "go"


def suspect(vouched_at: float | None, now: float, lease_s: float) -> bool:
    """Nothing vouched for this process within the lease: ask before acting."""
    return vouched_at is None or now - vouched_at > lease_s


class IncarnationFence:
    def __init__(self, client: CoordinatorClient, identity: Identity, lease_s: float | None = None,
                 timeout_s: float = FENCE_TIMEOUT_S, clock: Callable[[], float] = time.monotonic):
        """`lease_s`: how long a confirmation vouches for the state server; None: what the
        coordinator says (its heartbeat timeout). `timeout_s`: the most one question waits."""
        self.client, self.identity = client, identity
        self._fixed_lease = lease_s is not None
        self.lease_s = lease_s if lease_s is not None else FENCE_LEASE_S
        self.timeout_s = timeout_s
        self._clock = clock
        self.fenced: str | None = None
        """What the coordinator holds this incarnation to be once it refused it (superseded,
        failed, left; "evicted" if it did not say): sticky, an incarnation never comes back."""
        self._vouched_at: float | None = None
        self._serve_lock = threading.Lock()
        self._serve_failed_at = -math.inf
        self._told: set[str] = set()
        self._unsupported_told = False

    def vouch(self, sent_at: float, lease_s: float | None = None) -> None:
        """The coordinator answered a question asked at `sent_at` (a heartbeat, a confirmation)
        as for a live incarnation; `lease_s`: the lease it gave, if it said."""
        if lease_s is not None and not self._fixed_lease:
            self.lease_s = lease_s
        if self._vouched_at is None or sent_at > self._vouched_at:
            self._vouched_at = sent_at

    def learn(self, state: str | None) -> str:
        """The coordinator refused this incarnation (409): it is fenced from now on."""
        if self.fenced is None:
            self.fenced = state or "evicted"
        return self.fenced

    def line(self, consequence: str) -> str:
        return fenced_line(self.identity, self.fenced or "evicted", consequence)

    def evicted(self, message: str, state: str | None, consequence: str) -> Evicted:
        """The Evicted to raise where the coordinator refused this incarnation (its quorum
        request, a heartbeat), logged once per consequence ("step 11 not committed")."""
        self.learn(state)
        self._tell(self.line(consequence))
        return Evicted(message, 409, state=self.fenced)

    def confirm(self, action: str, thing: str) -> None:
        """Return if this incarnation may `action` ("write", "delete", "serve") `thing`
        ("checkpoint part 1 of step 10") now; `Fenced` if it may not, ever; CoordinatorError
        if that cannot be told now (nothing may be done yet: ask again later)."""
        sent = self._clock()
        answer: Literal["current", "refused", "none"] = "none"
        lease, why = None, ""
        try:
            told = self.client.fence(FenceRequest(identity=self.identity, what=f"{action} {thing}"[:200]),
                                     timeout_s=self.timeout_s)
            lease, answer = told.lease_s, "current"
            if not told.supported and not self._unsupported_told:
                self._unsupported_told = True  # writing unfenced beats never checkpointing again
                log.warning("the job's coordinator predates fencing (no /v1/fence): replica %d's checkpoint "
                            "writes are not fenced; update the operator's coordinator image",
                            self.identity.replica_id)
        except Evicted as e:
            self.learn(e.state)
            answer = "refused"
        except CoordinatorError as e:  # unreachable, restarting (404 until registered again), 5xx
            why = str(e)
        elapsed = self._clock() - sent
        outcome = verdict(self.fenced, answer, elapsed, self.timeout_s)
        if outcome == "fenced":
            raise Fenced(self.line(f"{thing} not {PAST.get(action, 'done')}"))
        if outcome == "unconfirmed":
            why = why or f"the answer took {elapsed:.1f}s to come back"
            raise CoordinatorError(f"could not confirm that replica {self.identity.replica_id} generation "
                                   f"{self.identity.generation} attempt {self.identity.attempt} is still current "
                                   f"({why}); {thing} not {PAST.get(action, 'done')} yet")
        self.vouch(sent, lease)

    def refusal(self) -> str | None:
        """Why this process may not serve its state now, or None (ft/state_server.py): fenced,
        or not vouched for within the lease and not confirmed when asked."""
        if self.fenced is not None:
            return self.line("state not served")
        if not suspect(self._vouched_at, self._clock(), self.lease_s):
            return None
        with self._serve_lock:  # one question at a time; the others wait for its answer
            if not suspect(self._vouched_at, self._clock(), self.lease_s):
                return None
            if self._clock() - self._serve_failed_at < RETRY_SERVE_S:
                return "not confirmed as the replica's current incarnation yet"
            try:
                self.confirm("serve", "state")
                return None
            except Fenced as e:
                self._tell(str(e))
                return str(e)
            except CoordinatorError as e:
                self._serve_failed_at = self._clock()
                return str(e)

    def _tell(self, line: str) -> None:
        if line not in self._told:
            self._told.add(line)
            log.error("%s", line)
