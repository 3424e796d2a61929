"""Quorum leases: while nothing changes, a round answers for the steps after it as well.

Every step costs each replica a round trip to the coordinator, on the step's critical
path, although in a quiet job every round decides the same quorum. With `quorum_lease_s`
above 0 (1 s by default, transom/defaults.py), a round that finds the job quiet
(`Membership._quiet` in membership.py:
the same members as the last round, no failed step, nobody catching up, nothing to announce,
no script values to hand out, no healthy replica waiting outside, the job not ending) grants
a lease: its answer carries `holds_until`, and its members train the steps up to that one
under the same quorum without asking (ft/exchange.py). They ask again for the step after it,
or earlier when their own step failed or they step aside.

The lease is as long as `quorum_lease_s` of the job's recent steps, so whatever a quiet job
cannot hear during it (a replica that wants to join, a verdict, its owner's finish) waits
about that long, as it would wait a step without the lease. A lease never covers fewer than
MIN_LEASE_STEPS steps (for one step the round trip it saves is not worth the wait it adds)
nor more than MAX_LEASE_STEPS. A step that fails under a lease ends it: every member asks
again, as after any failed step; a member that leaves its group closes it, so that a
peer already in the next leased step's collective fails it at once and asks too
(ft/process_group.py). The claims a replica may make grow with the lease
(claims.py): it may hold one step past `holds_until`.

Pure: the caller passes what it measured.
"""

from __future__ import annotations

import math

MIN_LEASE_STEPS = 2
MAX_LEASE_STEPS = 10_000
MAX_LEASE_S = 60.0  # the most `quorum_lease_s` may be: what a quiet job cannot hear waits about this long


def holds_until(lease_s: float, step_seconds: float | None, max_step: int, quiet: bool,
                end_step: int | None) -> int | None:
    """The last step a round at `max_step` answers for, or None for no lease: `quiet` is the
    round's (membership.py), `step_seconds` the job's recent time a step (None: not known
    yet), `end_step` where the job's owner asked it to end (the lease stops there)."""
    if not quiet or lease_s <= 0 or step_seconds is None:
        return None
    steps = MAX_LEASE_STEPS if step_seconds <= 0 else min(MAX_LEASE_STEPS, math.floor(lease_s / step_seconds))
    until = max_step + steps
    if end_step is not None:  # the round at end_step tells the members that the job ends there
        until = min(until, end_step - 1)
    return until if until - max_step >= MIN_LEASE_STEPS else None
