"""Which TokenReviews the coordinator sends for bearer strings it does not know.

Any bearer string that is neither the job's token nor a replica key is, to the coordinator,
maybe a pod's ServiceAccount token (kube_identity.py), and only the API server can say: one
TokenReview each. Unchecked, one caller's stream of made-up strings becomes a stream of
reviews (one flooder sent 244 a second to the API server), and those reviews take the slots
honest pods' first calls wait for. So, before a review is sent:

- a token the API server refused is refused again, without asking, for
  `KUBE_FAILED_REVIEW_TTL_S` (kept by its SHA-256, never the token; at most `MAX_FAILED`,
  the oldest forgotten first): a repeated bad token costs nothing;
- each caller (the peer address) has a bucket of `KUBE_REVIEW_BURST` reviews refilled at
  `KUBE_REVIEWS_PER_S`, and at most `MAX_IN_FLIGHT` reviews unanswered at once; past
  either, the call is refused with TooManyRequests (429) and no review is sent;
- a caller whose token was refused in the last `SUSPECT_S` is suspect: its reviews wait for
  `SUSPECT_SLOTS` slots of their own (kube_identity.py), never for those honest pods'
  reviews use, so a flood from many addresses still queues only behind itself.

An honest pod presents one token (its processes share it, and concurrent calls with one
token share one review), anew each time the kubelet refreshes it: far inside every limit.
What is left is a flooder's share: about `KUBE_REVIEWS_PER_S` reviews a second per address.

Pure bookkeeping, the clock passed in; no I/O.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from transom.defaults import KUBE_FAILED_REVIEW_TTL_S, KUBE_REVIEW_BURST, KUBE_REVIEWS_PER_S
from transom.errors import TooManyRequests

MAX_FAILED = 4096  # refused tokens remembered (by hash)
MAX_CALLERS = 4096  # callers whose budget is remembered; an idle one's is forgotten first
MAX_IN_FLIGHT = 4  # reviews of one caller unanswered at once
SUSPECT_S = 60.0  # a caller whose token was refused this lately is suspect
SUSPECT_SLOTS = 2  # reviews of suspect callers at the API server at once (kube_identity.py)


@dataclass
class _Caller:
    left: float  # reviews it may send now
    at: float  # when `left` was counted
    in_flight: int = 0
    suspect_until: float = float("-inf")


class ReviewGate:
    """The bookkeeping above; `kube_identity.KubeIdentity` asks it before each review."""

    def __init__(self, failed_ttl_s: float = KUBE_FAILED_REVIEW_TTL_S, burst: int = KUBE_REVIEW_BURST,
                 per_s: float = KUBE_REVIEWS_PER_S):
        self.failed_ttl_s, self.burst, self.per_s = failed_ttl_s, burst, per_s
        self._failed: collections.OrderedDict[str, float] = collections.OrderedDict()  # hash -> until
        self._callers: collections.OrderedDict[str, _Caller] = collections.OrderedDict()  # oldest touched first
        self.refused = 0  # calls refused here: tokens refused before, callers past their budget

    def known_failed(self, key: str, now: float) -> bool:
        """Whether the API server refused the token hashed as `key` lately (no review needed)."""
        until = self._failed.get(key)
        if until is None:
            return False
        if now >= until:
            del self._failed[key]
            return False
        self.refused += 1
        return True

    def admit(self, caller: str, now: float) -> None:
        """Count a review `caller` is about to send; TooManyRequests (and nothing counted) past
        its budget."""
        c = self._touch(caller, now)
        c.left = min(float(self.burst), c.left + (now - c.at) * self.per_s)
        c.at = now
        if c.left < 1.0 or c.in_flight >= MAX_IN_FLIGHT:
            self.refused += 1
            raise TooManyRequests("too many unknown credentials from this address: a credential is "
                                  "checked with the API server at most "
                                  f"{self.per_s:g} times a second per caller")
        c.left -= 1.0
        c.in_flight += 1

    def suspect(self, caller: str, now: float) -> bool:
        """Whether `caller` presented a token the API server refused lately."""
        c = self._callers.get(caller)
        return c is not None and now < c.suspect_until

    def done(self, caller: str, key: str, refused: bool, now: float) -> None:
        """`caller`'s review of the token hashed as `key` ended (answered or not); `refused`:
        the API server said it is no token of this job's pods."""
        c = self._callers.get(caller)
        if c is not None:
            c.in_flight = max(0, c.in_flight - 1)
        if not refused:
            return
        if c is not None:
            c.suspect_until = now + SUSPECT_S
        self._failed[key] = now + self.failed_ttl_s
        self._failed.move_to_end(key)
        while len(self._failed) > MAX_FAILED:
            self._failed.popitem(last=False)

    def _touch(self, caller: str, now: float) -> _Caller:
        c = self._callers.get(caller)
        if c is None:
            c = self._callers[caller] = _Caller(left=float(self.burst), at=now)
            self._forget_idle()
        self._callers.move_to_end(caller)
        return c

    def _forget_idle(self) -> None:
        """Forget the least recently seen callers with no review under way once there are too
        many (a forgotten one starts again with a full bucket and no suspicion: it was idle)."""
        if len(self._callers) <= MAX_CALLERS:
            return
        for caller in list(self._callers)[: len(self._callers) - MAX_CALLERS]:
            if self._callers[caller].in_flight == 0:
                del self._callers[caller]
