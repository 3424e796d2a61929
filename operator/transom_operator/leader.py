"""Leader election on a coordination.k8s.io Lease: two operator replicas never both act.

The holder renews the Lease every `renew_s`; another instance takes it over only once it
has not been renewed for `duration_s`. Updates carry the resourceVersion they read, so two
candidates racing for an expired Lease cannot both win (the loser gets 409). An instance
that cannot renew in time stops acting before anyone else may start (`is_leader` checks
its own last renewal against the duration). An instance that stops (its pod evicted by a
drain, a rollout) releases the Lease it holds, as client-go's ReleaseOnCancel does: the
standby, which has watched all along, takes over within `renew_s` instead of `duration_s`,
before the stopped pod's own replacement has started.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import UTC, datetime

from kubernetes import client
from kubernetes.client.rest import ApiException

from transom_operator import metrics

log = logging.getLogger("transom.operator")


def _now() -> datetime:
    return datetime.now(UTC)


def _fmt(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    def __init__(self, api: client.ApiClient, namespace: str, name: str, identity: str,
                 duration_s: int = 15, renew_s: float = 3.0):
        self.coord = client.CoordinationV1Api(api)
        self.namespace, self.name, self.identity = namespace, name, identity
        self.duration_s, self.renew_s = duration_s, renew_s
        self._renewed_at = 0.0  # monotonic time of our last successful renewal
        # A request that hangs must not outlive the lease: the loop would stop renewing without
        # noticing (is_leader turns False on its own, but nothing would try again).
        self._timeout = (renew_s, renew_s)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="transom-leader", daemon=True)

    def is_leader(self) -> bool:
        # Stop acting a safety margin before the Lease could be taken from us.
        return time.monotonic() - self._renewed_at < self.duration_s - self.renew_s

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Stop renewing and release the Lease if this instance holds it. Called once nothing
        acts for this instance any more (kopf has stopped)."""
        self._stop.set()
        if self._thread.is_alive():  # also called when the operator failed before starting it
            self._thread.join(timeout=10)
        held = self.is_leader()
        self._renewed_at = 0.0  # never act again, whatever the release does
        if held:
            try:
                self._release()
            except Exception as e:  # the Lease then expires after duration_s, as if we crashed
                log.warning("leader election: could not release the lease: %s", e)

    def _release(self) -> None:
        """Mark the Lease free (no holder, expired a second after now), only if we still hold it:
        the update carries the resourceVersion read, so a Lease taken meanwhile is left alone."""
        lease = self.coord.read_namespaced_lease(self.name, self.namespace, _request_timeout=self._timeout)
        if lease.spec.holder_identity != self.identity:
            return
        body = {"metadata": {"name": self.name, "resourceVersion": lease.metadata.resource_version},
                "spec": {"holderIdentity": None, "leaseDurationSeconds": 1, "renewTime": _fmt(_now()),
                         "acquireTime": None}}
        self.coord.replace_namespaced_lease(self.name, self.namespace, body, _request_timeout=self._timeout)
        metrics.IS_LEADER.set(0)
        log.info("released leadership (lease %s/%s)", self.namespace, self.name)

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self._try_once()
            except Exception as e:  # API briefly unavailable: keep trying, stop acting when stale
                log.warning("leader election: %s", e)
            metrics.IS_LEADER.set(1 if self.is_leader() else 0)
            self._stop.wait(self.renew_s)

    def _try_once(self) -> None:
        now = _now()
        spec = {"holderIdentity": self.identity, "leaseDurationSeconds": self.duration_s,
                "renewTime": _fmt(now)}
        try:
            lease = self.coord.read_namespaced_lease(self.name, self.namespace, _request_timeout=self._timeout)
        except ApiException as e:
            if e.status != 404:
                raise
            body = {"metadata": {"name": self.name}, "spec": {**spec, "acquireTime": _fmt(now)}}
            try:
                self.coord.create_namespaced_lease(self.namespace, body, _request_timeout=self._timeout)
                self._won()
            except ApiException as e2:
                if e2.status != 409:
                    raise
            return
        holder = lease.spec.holder_identity
        renewed = lease.spec.renew_time or lease.spec.acquire_time
        expired = renewed is None or (now - renewed).total_seconds() > (lease.spec.lease_duration_seconds or 0)
        if holder and holder != self.identity and not expired:  # no holder: released
            return
        body = {"metadata": {"name": self.name, "resourceVersion": lease.metadata.resource_version},
                "spec": {**spec, "acquireTime": _fmt(now) if holder != self.identity else
                         _fmt(lease.spec.acquire_time or now)}}
        try:
            self.coord.replace_namespaced_lease(self.name, self.namespace, body, _request_timeout=self._timeout)
            if holder != self.identity:
                log.info("acquired leadership (lease %s/%s) from %s", self.namespace, self.name, holder)
            self._won()
        except ApiException as e:
            if e.status != 409:  # 409: someone else updated it first
                raise

    def _won(self) -> None:
        self._renewed_at = time.monotonic()
