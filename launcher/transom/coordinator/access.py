"""Who may call the coordinator, and about whom: the bearer credential names a caller
(`identify`: the job's token, a replica key, or a pod's service-account token), and a call
about another replica than the caller's own is refused (`authorize`, 403). The rules of who
may say what are identity.py's; this is the door that applies them to HTTP requests."""

from __future__ import annotations

import hmac
from typing import TYPE_CHECKING

from aiohttp import web

from transom.coordinator import http
from transom.coordinator.fencing import ENDPOINTS, Refusals
from transom.coordinator.identity import ADMIN, Principal, ReplicaKeys, is_replica_key
from transom.coordinator.models import Identity
from transom.errors import Forbidden

if TYPE_CHECKING:
    from transom.coordinator.kube_identity import KubeIdentity

MAX_CREDENTIAL = 16384  # characters of a bearer credential; longer is no credential


class Access:
    """The coordinator's door. `token`: the job's (admin) token; `replica_keys` and
    `kube_identity`: how replicas prove who they are (identity.py, kube_identity.py);
    `refusals`: where the 401s are counted per endpoint."""

    def __init__(self, token: str, refusals: Refusals, replica_keys: ReplicaKeys | None = None,
                 kube_identity: KubeIdentity | None = None):
        if not token:
            raise ValueError("a coordinator needs a non-empty token")
        self._token = token.encode()
        self._replica_keys = replica_keys
        self._kube_identity = kube_identity
        self._refusals = refusals

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Every call under /v1/ names its caller (401 otherwise), left at http.PRINCIPAL."""
        if request.path.startswith("/v1/"):
            principal = await self.identify(request.headers.get("Authorization", ""), request.remote or "")
            if principal is None:
                resource = request.match_info.route.resource
                endpoint = resource.canonical if resource is not None else "other"
                if endpoint in ENDPOINTS:  # a bounded label: other paths are not counted
                    self._refusals.unauthenticated[endpoint] += 1
                return http.error(401, "missing or wrong bearer token")
            request[http.PRINCIPAL] = principal
        return await handler(request)

    async def authorize(self, request: web.Request, identity: Identity, node_rank: int | None = None,
                        replica_only: bool = False) -> None:
        """Forbidden unless the caller may speak for `identity` (only its replica, with
        `replica_only`). A pod's labels are read again once before a refusal: a spare the
        operator just relabelled as a replica speaks for it from that moment."""
        principal = http.principal(request)
        request[http.SUBJECT] = (identity, None)
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

    async def identify(self, header: str, peer: str = "") -> Principal | None:
        """The caller a bearer credential names, None if it names nobody; TooManyRequests (429)
        when `peer` (its address) has sent more unknown credentials than are checked for it
        (coordinator/review_gate.py)."""
        scheme, _, presented = header.partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented or len(presented) > MAX_CREDENTIAL:
            return None
        # Header bytes that are not UTF-8 arrive as surrogates: still just a wrong token.
        if hmac.compare_digest(presented.encode("utf-8", "surrogateescape"), self._token):
            return ADMIN
        if self._replica_keys is not None and is_replica_key(presented):
            return self._replica_keys.principal(presented)
        if self._kube_identity is not None and presented.isascii():
            return await self._kube_identity.principal(presented, peer)
        return None

    async def close(self) -> None:
        if self._kube_identity is not None:
            await self._kube_identity.close()
