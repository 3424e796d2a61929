"""What the coordinator says of this launcher's replica, kept current by a long-poll.

The launcher must learn at once when the coordinator declares its replica failed (missed
heartbeats, a hang, a detector's verdict) or superseded by a newer incarnation, to stop its
workers. Asking once a second would cost the coordinator a request per node per second:
12,500 a second for 100,000 GPUs in 8-GPU nodes, each on a new connection. The long-poll
(`GET /v1/replicas/{id}?known=S&wait_s=W`) is answered when the state is no longer S, or
after W seconds: one request per node per W seconds, and a change is seen within the
coordinator's tick (50 ms) instead of within a second. W is drawn anew for each poll from
[WAIT_S / 2, WAIT_S]: launchers start together with their job, and polls that all expire
in the same instant would reach the coordinator as one burst (10,000 answers and requests
at once stalled its quorum answers by a second in a trial on the 2-core box).

A coordinator that cannot be reached leaves `latest` as it was (the workers decide for
themselves then, as their own requests fail) and is asked again after `RETRY_S`. Once the
job completed, the watch stops: the coordinator answers every poll at once from then on,
and a launcher whose workers still wrote their last files asked about a thousand times a
second until they exited.

One thread per attempt, owned by the supervisor: `stop()` shuts the socket of the poll in
flight, so the poll returns at once and the thread ends; nothing outlives the attempt.
"""

from __future__ import annotations

import http.client
import logging
import random
import socket
import threading
from collections.abc import Callable
from urllib.parse import urlsplit

from transom.coordinator.client import replica_state_path
from transom.coordinator.models import Identity, IncarnationAnswer
from transom.defaults import MAX_STATE_WAIT_S

log = logging.getLogger("transom.launch")
WAIT_S = MAX_STATE_WAIT_S  # each poll asks the coordinator to hold it as long as it may
RETRY_S = 1.0  # after a failed poll
CONNECT_TIMEOUT_S = 5.0  # beyond the poll's own wait


class StateWatch:
    def __init__(self, url: str, token: str | Callable[[], str], identity: Identity, wait_s: float = WAIT_S):
        """`token`: the bearer credential, or a function that returns the current one."""
        split = urlsplit(url)
        self._https = split.scheme == "https"
        self._host, self._port = split.hostname or "127.0.0.1", split.port
        self._base = split.path.rstrip("/")
        self._token = token if callable(token) else (lambda: token)
        self._identity, self._wait_s = identity, wait_s
        self._stopped = threading.Event()
        self._conn: http.client.HTTPConnection | None = None
        self.latest: IncarnationAnswer | None = None
        """The newest answer (None until the first)."""
        self.polls = 0  # answered polls, for tests and logs
        self._thread = threading.Thread(target=self._run, name=f"transom-state-watch-r{identity.replica_id}",
                                        daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stopped.set()  # before looking at the socket: see _ask
        conn = self._conn
        sock = conn.sock if conn is not None else None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self._thread.join(timeout_s)

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while not self._stopped.is_set():
            known = self.latest.state if self.latest is not None else None
            try:
                state = self._ask(known)
            except Exception as e:  # unreachable or restarting coordinator: ask again soon
                if not self._stopped.is_set():
                    log.debug("replica %d state poll failed: %s", self._identity.replica_id, e)
                    self._stopped.wait(RETRY_S)
                continue
            if state is not None:
                self.latest = state
                self.polls += 1
                if state.job_completed:  # nothing changes any more, and every poll would be answered at once
                    return

    def _ask(self, known: str | None) -> IncarnationAnswer | None:
        """One poll; None if stopped meanwhile."""
        cls = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self._wait_s + CONNECT_TIMEOUT_S)
        self._conn = conn
        try:
            conn.connect()
            # stop() sets the flag, then shuts the socket if it sees one: a connect that ended
            # after stop() looked finds the flag set here.
            if self._stopped.is_set():
                return None
            wait_s = random.uniform(self._wait_s / 2, self._wait_s) if known else 0.0
            path = self._base + replica_state_path(self._identity, known, round(wait_s, 1))
            conn.request("GET", path, headers={"Authorization": f"Bearer {self._token()}"})
            resp = conn.getresponse()
            body = resp.read()
            if resp.status != 200:
                raise ConnectionError(f"replica state: HTTP {resp.status}: {body[:200]!r}")
            return IncarnationAnswer.model_validate_json(body)  # data only: validated, never executed
        finally:
            self._conn = None
            conn.close()
