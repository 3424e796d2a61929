"""A worker pod's identity in Kubernetes: its own ServiceAccount token, checked by the API server.

Every worker pod mounts a projected token of the job's worker ServiceAccount `<job>-worker`,
bound to that pod and to the audience `transom.io/<namespace>/<job>`
(`contract.identity_audience`), which the kubelet refreshes; the launcher and the workers
present it to the coordinator. The coordinator asks the API server about it (a TokenReview
with that audience): an authenticated answer names the ServiceAccount and the pod the token
is bound to (its name and uid). The coordinator then reads that pod, checks its uid, and
takes the replica, generation and node rank from the operator's labels on it
(`transom.io/replica`, `transom.io/generation`, `transom.io/node-rank`; a hot spare has
none until the operator relabels it as a replica). A job's user cannot forge these: the
token is signed by the API server and bound to one pod, and the labels are the operator's
(the schema refuses `transom.io/` keys in a pod template).

Why not a secret per pod: a pod's environment cannot change when a spare is promoted, and
secrets per pod are objects to create, rotate and garbage-collect; the platform's bound
tokens already expire with the pod. What it costs: the coordinator may create TokenReviews
(a ClusterRole the chart ships, bound per job by the operator) and get pods in its
namespace (its Role). Answers are cached (`REVIEW_TTL_S` per token, `POD_TTL_S` per pod;
a pod is read again at once, at most once a second, when its caller claims an identity the
cached labels do not give: a spare just promoted). An API server that does not answer is a
503, which the replicas' clients retry.

A review is sent only for a token it has not refused lately, within its caller's budget,
and concurrent calls with one token share one review (review_gate.py): a flood of made-up
bearer strings costs the API server a few reviews a second per address, and never takes the
slots honest pods' reviews wait for. Tokens are never logged: only their SHA-256 is kept.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from dataclasses import dataclass

import aiohttp

from transom import contract
from transom.coordinator.identity import Principal
from transom.coordinator.kube_api import REQUEST_TIMEOUT_S, KubeApi
from transom.coordinator.review_gate import SUSPECT_SLOTS, ReviewGate
from transom.defaults import KUBE_POD_TTL_S as POD_TTL_S
from transom.defaults import KUBE_REFRESH_GAP_S as REFRESH_GAP_S
from transom.defaults import KUBE_REVIEW_TTL_S as REVIEW_TTL_S
from transom.errors import CoordinatorError

log = logging.getLogger("transom.coordinator")
MAX_CACHED = 100_000
API_CONCURRENCY = 16
POD_NAME = "authentication.kubernetes.io/pod-name"
POD_UID = "authentication.kubernetes.io/pod-uid"


@dataclass(frozen=True)
class _Review:
    pod: str
    uid: str
    at: float


@dataclass(frozen=True)
class _Pod:
    principal: Principal
    at: float


class KubeIdentity:
    """Tokens of `service_account` pods in `namespace`, for the job `job`'s coordinator."""

    def __init__(self, api: KubeApi, namespace: str, job: str, service_account: str,
                 audience: str | None = None, clock=time.monotonic):
        self.api, self.namespace, self.job, self.clock = api, namespace, job, clock
        self.username = f"system:serviceaccount:{namespace}:{service_account}"
        self.audience = audience or contract.identity_audience(namespace, job)
        self._reviews: dict[str, _Review] = {}
        self._pods: dict[str, _Pod] = {}  # uid -> what its labels said
        self._session: aiohttp.ClientSession | None = None
        # A bounded number of API reads at once: a job's pods registering together (thousands at
        # its start) queue here rather than all at the API server. Callers whose tokens were
        # refused lately have slots of their own (review_gate.py).
        self._api_slots = asyncio.Semaphore(API_CONCURRENCY)
        self._suspect_slots = asyncio.Semaphore(SUSPECT_SLOTS)
        self.gate = ReviewGate()
        self._pending: dict[str, asyncio.Future[_Review | None]] = {}  # token hash -> its review under way
        self.reviews_sent = 0

    async def principal(self, token: str, caller: str = "") -> Principal | None:
        """The pod `token` speaks for, None if it is no token of this job's worker pods;
        TooManyRequests past `caller`'s (its peer address's) budget of reviews."""
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self.clock()
        review = self._reviews.get(key)
        if review is None or now - review.at > REVIEW_TTL_S:
            if self.gate.known_failed(key, now):
                return None
            pending = self._pending.get(key)
            if pending is None:  # calls with one token at once share one review
                self.gate.admit(caller, now)
                pending = self._pending[key] = asyncio.ensure_future(self._reviewed(token, key, caller))
                pending.add_done_callback(lambda _: self._pending.pop(key, None))
            review = await asyncio.shield(pending)
            if review is None:
                return None
        return await self._pod(review, refresh=False)

    async def _reviewed(self, token: str, key: str, caller: str) -> _Review | None:
        slots = self._suspect_slots if self.gate.suspect(caller, self.clock()) else self._api_slots
        review, answered = None, False
        try:
            async with slots:
                self.reviews_sent += 1
                review = await self._review(token, self.clock())
            answered = True
        finally:  # an API server that did not answer refused nothing: the token is not remembered
            self.gate.done(caller, key, refused=answered and review is None, now=self.clock())
        if review is not None:
            self._remember(self._reviews, key, review)
        return review

    async def refresh(self, principal: Principal) -> Principal | None:
        """`principal` read again from its pod now (at most once a second per pod)."""
        if principal.pod is None:
            return principal
        pod, uid = principal.pod
        cached = self._pods.get(uid)
        if cached is not None and self.clock() - cached.at < REFRESH_GAP_S:
            return principal
        return await self._pod(_Review(pod=pod, uid=uid, at=self.clock()), refresh=True)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    # --- the API server -------------------------------------------------------------------------
    def _client(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.api.ssl_context()),
                                                  timeout=aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S))
        return self._session

    async def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        try:
            async with self._client().request(method, self.api.path(path), json=body,
                                              headers=self.api.headers()) as resp:
                return resp.status, await resp.json(content_type=None)
        except (TimeoutError, aiohttp.ClientError, ValueError, OSError) as e:
            raise CoordinatorError(f"the API server did not answer about an identity: {e}") from None

    async def _review(self, token: str, now: float) -> _Review | None:
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview",
                "spec": {"token": token, "audiences": [self.audience]}}
        status, answer = await self._call("POST", "/apis/authentication.k8s.io/v1/tokenreviews", body)
        if status >= 300:
            # The Status's message only: an answer may echo the request, and the token in it.
            said = answer.get("message", "") if isinstance(answer, dict) else ""
            raise CoordinatorError(f"TokenReview answered {status}: {str(said)[:200]}")
        st = answer.get("status") or {}
        user = st.get("user") or {}
        extra = user.get("extra") or {}
        pod, uid = (extra.get(POD_NAME) or [None])[0], (extra.get(POD_UID) or [None])[0]
        if not st.get("authenticated") or user.get("username") != self.username or not pod or not uid:
            return None  # not a token of this job's worker pods (or not bound to a pod)
        if self.audience not in (st.get("audiences") or [self.audience]):
            return None
        return _Review(pod=pod, uid=uid, at=now)

    async def _pod(self, review: _Review, refresh: bool) -> Principal | None:
        now = self.clock()
        cached = self._pods.get(review.uid)
        if cached is not None and not refresh and now - cached.at <= POD_TTL_S:
            return cached.principal
        async with self._api_slots:
            status, pod = await self._call("GET", f"/api/v1/namespaces/{self.namespace}/pods/{review.pod}")
        if status == 404:
            return None  # deleted: its token speaks for nobody any more
        if status >= 300:
            raise CoordinatorError(f"reading pod {review.pod} answered {status}")
        meta = pod.get("metadata") or {}
        if meta.get("uid") != review.uid:
            return None  # a pod of the same name, created after the token's pod was deleted
        principal = principal_of(meta.get("labels") or {}, self.job, review.pod, review.uid)
        if principal is not None:
            self._remember(self._pods, review.uid, _Pod(principal, now))
        return principal

    @staticmethod
    def _remember(cache: dict, key: str, value) -> None:
        if len(cache) >= MAX_CACHED:
            cache.clear()  # crude, and rare: a job has far fewer pods
        cache[key] = value


def principal_of(labels: dict, job: str, pod: str, uid: str) -> Principal | None:
    """The principal the operator's labels on pod `pod` make it, None if it is not the job's."""
    if labels.get(contract.LABEL_JOB) != job:
        return None
    name = f"pod {pod}"
    try:
        replica = int(labels[contract.LABEL_REPLICA])
        generation = int(labels[contract.LABEL_GENERATION])
        node_rank = int(labels.get(contract.LABEL_NODE_RANK, "0"))
    except (KeyError, ValueError):
        return Principal(name=name, pod=(pod, uid))  # a spare not promoted yet: no replica to speak for
    return Principal(name=name, replica_id=replica, generation=generation, node_rank=node_rank, pod=(pod, uid))
