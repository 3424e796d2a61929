"""The coordinator's roster: each replica id's newest incarnation (`Replica`), and the
questions several modules ask of them (is this incarnation the live one, which heartbeats
stopped, how many are healthy, how far the furthest got). Pure: no clock of its own, no I/O.

Only registration adds or replaces a record (`put`); everything else changes a record in
place (membership.py declares it failed, incarnations.py marks it left or aside), so the
roster is a read-only mapping with a handful of queries, handed as such to rounds.py."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from transom.coordinator.models import Identity
from transom.coordinator.records import Replica
from transom.errors import Evicted, NotRegistered
from transom.words import IncarnationState


class Roster(Mapping[int, Replica]):
    """The record of each replica id's newest incarnation, by replica id."""

    def __init__(self) -> None:
        self._by_id: dict[int, Replica] = {}

    def __getitem__(self, replica_id: int) -> Replica:
        return self._by_id[replica_id]

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_id)

    def __len__(self) -> int:
        return len(self._by_id)

    def put(self, rep: Replica) -> None:
        """Record `rep` as its replica id's newest incarnation (the older record is dropped:
        its failures were carried over by the caller)."""
        self._by_id[rep.identity.replica_id] = rep

    def current(self, identity: Identity) -> Replica | None:
        """The record of exactly this incarnation while it is healthy, else None (an older or
        newer incarnation, or one declared failed or gone)."""
        rep = self._by_id.get(identity.replica_id)
        if rep is None or rep.state != IncarnationState.HEALTHY or rep.identity.key() != identity.key():
            return None
        return rep

    def live(self, identity: Identity) -> Replica:
        """The record of a live incarnation, or Evicted/NotRegistered (the caller is told which,
        so that a superseded or failed incarnation stops rather than retries)."""
        return self._newest(identity, (IncarnationState.HEALTHY,))

    def reporting(self, identity: Identity) -> Replica:
        """The record of an incarnation whose word about its past steps still counts: a live
        one, or one that left on its own (its launcher posts its last rows after its workers
        left the job). A failed or superseded one's is refused as `live` refuses it."""
        return self._newest(identity, (IncarnationState.HEALTHY, IncarnationState.LEFT))

    def _newest(self, identity: Identity, states: tuple[IncarnationState, ...]) -> Replica:
        rep = self._by_id.get(identity.replica_id)
        if rep is None:
            raise NotRegistered(f"replica {identity.replica_id} is not registered")
        if rep.identity.key() != identity.key():
            raise Evicted(
                f"replica {identity.replica_id} incarnation {identity.key()} is superseded by {rep.identity.key()}"
            )
        if rep.state not in states:
            raise Evicted(f"replica {identity.replica_id} was declared {rep.state}: {rep.last_failure or 'left'}")
        return rep

    def expired(self, now: float, timeout_s: float) -> list[tuple[Replica, float]]:
        """The healthy incarnations whose last heartbeat is older than `timeout_s`, with its age."""
        return [(rep, now - rep.last_heartbeat) for rep in self._by_id.values()
                if rep.state == IncarnationState.HEALTHY and now - rep.last_heartbeat > timeout_s]

    def healthy_count(self) -> int:
        return sum(1 for r in self._by_id.values() if r.state == IncarnationState.HEALTHY)

    def max_step(self) -> int:
        """The highest step any replica (of any state) reported committed."""
        return max((r.step for r in self._by_id.values()), default=0)
