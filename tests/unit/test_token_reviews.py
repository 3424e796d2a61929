"""TokenReviews for bearer strings the coordinator does not know (coordinator/review_gate.py,
kube_identity.py, access.py), against a fake API server that counts the reviews it gets.

What is measured is counts and order (reviews sent, reviews under way, which calls finished
while a flood's reviews were still unanswered), never wall time: the machine is shared."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path

import pytest

from transom import contract
from transom.coordinator.access import Access
from transom.coordinator.fencing import Refusals
from transom.coordinator.identity import Principal
from transom.coordinator.kube_api import KubeApi
from transom.coordinator.kube_identity import POD_NAME, POD_UID, KubeIdentity
from transom.coordinator.review_gate import MAX_IN_FLIGHT, SUSPECT_SLOTS
from transom.defaults import KUBE_FAILED_REVIEW_TTL_S, KUBE_REVIEW_BURST, KUBE_REVIEWS_PER_S
from transom.errors import TooManyRequests

GOOD = "a-real-pod-token"
HONEST, FLOODER = "10.0.0.1", "10.0.0.66"


class FakeApiServer(KubeIdentity):
    """Answers TokenReviews itself: GOOD is replica 0's pod's token, anything else no token.
    While `hold` is set, reviews of other tokens wait (a slow API server, or a flood's share of it)."""

    def __init__(self) -> None:
        self.t: float = 0.0
        super().__init__(KubeApi("https://api", Path("/none"), Path("/none")), "ns", "tj", "tj-worker",
                         clock=lambda: self.t)
        self.reviews: list[str] = []
        self.in_review = self.most_in_review = 0
        self.hold: asyncio.Event | None = None

    async def _call(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        if method == "GET":
            return 200, {"metadata": {"uid": "u0", "labels": {contract.LABEL_JOB: "tj", contract.LABEL_REPLICA: "0",
                                                              contract.LABEL_GENERATION: "0"}}}
        assert body is not None
        token = body["spec"]["token"]
        self.reviews.append(token)
        self.in_review += 1
        self.most_in_review = max(self.most_in_review, self.in_review)
        try:
            if token == GOOD:
                return 201, {"status": {"authenticated": True, "audiences": [self.audience], "user": {
                    "username": self.username, "extra": {POD_NAME: ["tj-r0-n0-g0"], POD_UID: ["u0"]}}}}
            if self.hold is not None:
                await self.hold.wait()
            return 201, {"status": {"authenticated": False}}
        finally:
            self.in_review -= 1


def door() -> tuple[Access, FakeApiServer]:
    kube = FakeApiServer()
    return Access("the-admin-token", Refusals(), kube_identity=kube), kube


def replica(p: Principal | None) -> int | None:
    return p.replica_id if p is not None else None


async def spin(n: int = 50) -> None:
    """Let every task that can run, run (a count of turns of the loop, not a time)."""
    for _ in range(n):
        await asyncio.sleep(0)


def test_one_callers_repeated_bad_token_costs_one_review_until_its_refusal_expires():
    async def main() -> None:
        access, kube = door()
        for _ in range(50):
            assert await access.identify("Bearer not-a-token", FLOODER) is None
        assert len(kube.reviews) == 1
        assert await asyncio.gather(*(access.identify("Bearer another", FLOODER) for _ in range(50))) == [None] * 50
        assert len(kube.reviews) == 2  # 50 calls at once: one review
        kube.t += KUBE_FAILED_REVIEW_TTL_S
        assert await access.identify("Bearer not-a-token", FLOODER) is None
        assert len(kube.reviews) == 3

    asyncio.run(main())


def test_one_callers_distinct_bad_tokens_are_reviewed_within_its_budget_then_refused_with_429():
    async def main() -> None:
        access, kube = door()
        refused = 0
        for i in range(100):
            try:
                assert await access.identify(f"Bearer made-up-{i}", FLOODER) is None
            except TooManyRequests:
                refused += 1
        assert (len(kube.reviews), refused) == (KUBE_REVIEW_BURST, 100 - KUBE_REVIEW_BURST)
        assert replica(await access.identify(f"Bearer {GOOD}", HONEST)) == 0  # another caller: its own budget
        kube.t += 2 / KUBE_REVIEWS_PER_S  # the flooder's budget refills at its pace
        for i in range(100, 110):
            with pytest.raises(TooManyRequests) if i >= 102 else contextlib.nullcontext():
                await access.identify(f"Bearer made-up-{i}", FLOODER)
        assert len(kube.reviews) == KUBE_REVIEW_BURST + 1 + 2

    asyncio.run(main())


def test_an_honest_pods_first_review_does_not_wait_behind_a_flood_the_api_server_is_slow_on():
    async def main() -> None:
        access, kube = door()
        kube.hold = asyncio.Event()
        flood = [asyncio.ensure_future(access.identify(f"Bearer made-up-{i}", FLOODER)) for i in range(100)]
        await spin()
        assert kube.in_review <= MAX_IN_FLIGHT  # the rest were refused (429) without a review
        honest = asyncio.ensure_future(access.identify(f"Bearer {GOOD}", HONEST))
        await spin()
        assert honest.done() and replica(honest.result()) == 0  # while every flood review is unanswered
        kube.hold.set()
        results = await asyncio.gather(*flood, return_exceptions=True)
        assert sum(isinstance(r, TooManyRequests) for r in results) >= 100 - MAX_IN_FLIGHT

    asyncio.run(main())


def test_callers_whose_tokens_were_refused_share_a_few_slots_of_their_own():
    async def main() -> None:
        access, kube = door()
        flooders = [f"10.1.0.{i}" for i in range(16)]
        for f in flooders:  # each has had a token refused: suspect from now on
            assert await access.identify(f"Bearer first-{f}", f) is None
        kube.hold = asyncio.Event()
        flood = [asyncio.ensure_future(access.identify(f"Bearer again-{f}-{i}", f))
                 for f in flooders for i in range(MAX_IN_FLIGHT)]
        await spin()
        assert kube.in_review == SUSPECT_SLOTS  # 64 reviews admitted; 2 at the API server at once
        honest = asyncio.ensure_future(access.identify(f"Bearer {GOOD}", HONEST))
        await spin()
        assert honest.done() and replica(honest.result()) == 0
        kube.hold.set()
        await asyncio.gather(*flood, return_exceptions=True)
        assert kube.most_in_review <= SUSPECT_SLOTS + 1

    asyncio.run(main())


def test_no_token_is_kept_or_told_only_its_hash(caplog):
    async def main() -> None:
        access, kube = door()
        with caplog.at_level("DEBUG"):
            await access.identify("Bearer secret-looking-token", FLOODER)
        assert "secret-looking-token" not in caplog.text
        assert not any("secret-looking-token" in k for k in kube.gate._failed)

    asyncio.run(main())
