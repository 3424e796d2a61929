"""Whom a hang waits for, from the ranks' collective counts (transom/detect/hangs.py), and the
counter the workers keep them in (transom/collective_counts.py). Pure: no processes."""

from __future__ import annotations

import struct
import threading

from transom import collective_counts
from transom.detect.hangs import CollectiveLedger, RankCounts, behind_across, laggard

MEMBERS = [0, 1, 2]


def counts(rank: int, group: tuple[int, int], ftar: tuple[int, int] = (40, 40), group_id: int = 4) -> RankCounts:
    """`group`, `ftar`: (entered, completed)."""
    return RankCounts(rank=rank, group_id=group_id, ftar_entered=ftar[0], ftar_completed=ftar[1],
                      group_entered=group[0], group_completed=group[1])


def hung_world(ledger: CollectiveLedger, now: float = 0.0) -> None:
    """Rank 1 of replica 2 never entered all-reduce 41 of quorum 4: rank 0 of replica 2 went
    on to the commit vote (control collective 31) and waits in it; rank 1 of replicas 0 and 1
    entered all-reduce 41 and waits in it; their rank 0 wait in their own vote for it."""
    for r in (0, 1):
        ledger.record(r, counts(0, (31, 30), (41, 41)), now)
        ledger.record(r, counts(1, (30, 30), (41, 40)), now)
    ledger.record(2, counts(0, (31, 30), (41, 41)), now)
    ledger.record(2, counts(1, (30, 30), (40, 40)), now)


def test_the_rank_its_replica_waits_for_is_named_with_the_evidence():
    c = laggard(2, {0: counts(0, (31, 30)), 1: counts(1, (30, 30))})
    assert c is not None and (c.replica, c.rank) == (2, 1)
    assert c.evidence == ("rank 1 of replica 2 entered 30 of its replica's collectives, "
                          "the others (rank 0) entered 31 and wait in it")


def test_no_rank_is_named_when_the_counts_do_not_say_so_plainly():
    assert laggard(0, {0: counts(0, (30, 30))}) is None  # one rank: nothing to compare
    assert laggard(0, {0: counts(0, (30, 30)), 1: counts(1, (30, 30))}) is None  # level
    assert laggard(0, {0: counts(0, (31, 31)), 1: counts(1, (30, 30))}) is None  # ahead, but not waiting
    assert laggard(0, {0: counts(0, (31, 30)), 1: counts(1, (30, 29))}) is None  # the laggard waits too
    # Two ranks behind: the lowest is named; all the others wait.
    c = laggard(0, {0: counts(0, (9, 8)), 1: counts(1, (8, 8)), 2: counts(2, (9, 8)), 3: counts(3, (8, 8))})
    assert c is not None and c.rank == 1 and "the others (ranks 0, 2)" in c.evidence


def test_the_hung_replicas_own_watchdog_gets_the_rank_that_never_arrived():
    """Its watchdog named rank 0 (waiting in the vote, in a wait it could not see as one): the
    counts name rank 1, and the other replicas, waiting for it in the all-reduce, say so too."""
    ledger = CollectiveLedger()
    hung_world(ledger)
    c = ledger.blame(2, 0, MEMBERS, now=10.0, stall_s=2.5)
    assert c is not None and (c.replica, c.rank) == (2, 1)
    assert c.evidence.startswith("rank 1 of replica 2 entered 30 of its replica's collectives")
    assert "rank 1 of replicas 0, 1 entered all-reduce 41 of quorum 4, which it never entered" in c.evidence


def test_a_waiting_replicas_watchdog_blames_the_member_that_never_arrived():
    """Replica 0's watchdog fired on its rank 1, which waits in the all-reduce: the member it
    waits for is rank 1 of replica 2, which shows it itself and was seen to stall."""
    ledger = CollectiveLedger()
    hung_world(ledger)
    c = ledger.blame(0, 1, MEMBERS, now=10.0, stall_s=2.5)
    assert c is not None and (c.replica, c.rank) == (2, 1)
    assert "rank 1 of replica 2 entered 40 all-reduces of quorum 4" in c.evidence
    assert "rank 1 of replica 0 entered 41 and waits in it" in c.evidence
    # Replica 2's own counts refine it: its rank 0 waits for its rank 1 (here the same rank).
    assert "rank 1 of replica 2 entered 30 of its replica's collectives" in c.evidence


def test_across_replicas_the_inner_laggard_is_named():
    """Rank 0 of replica 2 is behind in the all-reduce because it waits in its replica's
    broadcast for rank 1, which never came: rank 1 is named."""
    ledger = CollectiveLedger()
    ledger.record(0, counts(0, (30, 30), (41, 40)), 0.0)
    ledger.record(2, counts(0, (31, 30), (40, 40)), 0.0)
    ledger.record(2, counts(1, (30, 30), (40, 40)), 0.0)
    c = ledger.blame(0, 0, MEMBERS, now=10.0, stall_s=2.5)
    assert c is not None and (c.replica, c.rank) == (2, 1)


def test_a_replica_the_coordinator_did_not_see_stall_is_not_blamed_by_another():
    ledger = CollectiveLedger()
    hung_world(ledger)
    ledger.record(2, counts(1, (30, 30), (40, 40), group_id=4), 0.0)
    ledger.record(2, counts(1, (31, 31), (41, 41)), 9.0)  # it moved 1 s ago: it is slow, not hung
    assert ledger.blame(0, 1, MEMBERS, now=10.0, stall_s=2.5) is None
    # Not a member of the quorum: it was not expected in the collective.
    ledger = CollectiveLedger()
    hung_world(ledger)
    assert ledger.blame(0, 1, [0, 1], now=10.0, stall_s=2.5) is None
    # It asked for the open round: it arrived (a paused job's replicas all stall, and asked).
    ledger = CollectiveLedger()
    hung_world(ledger)
    assert ledger.blame(0, 1, MEMBERS, now=10.0, stall_s=2.5, asked=[2]) is None
    # Another group (a quorum it is not in yet): its counts are not comparable.
    ledger = CollectiveLedger()
    hung_world(ledger)
    ledger.record(2, counts(1, (30, 30), (3, 3), group_id=5), 0.0)
    assert ledger.blame(0, 1, MEMBERS, now=10.0, stall_s=2.5) is None


def test_a_liar_condemns_no_one_else():
    """Replica 0 posts that its rank 1 entered 1,000 all-reduces and waits, and its watchdog
    fires, while replicas 1 and 2 stand level (a quiet moment, neither moved for 10 s): replica
    1's honest count keeps replica 2 from being named behind, and the reverse; no one is blamed
    by replica 0's word, and the verdict falls back to the watchdog's (replica 0)."""
    ledger = CollectiveLedger()
    for r in (1, 2):
        ledger.record(r, counts(1, (30, 30), (41, 41)), 0.0)
    ledger.record(0, counts(1, (30, 30), (1000, 999)), 0.0)
    assert ledger.blame(0, 1, MEMBERS, now=10.0, stall_s=2.5) is None
    # Even a replica that stalled is not blamed unless its own counts put it behind.
    ledger.record(2, counts(1, (30, 30), (41, 40)), 0.0)  # it waits in the same all-reduce
    assert ledger.blame(0, 1, MEMBERS, now=10.0, stall_s=2.5) is None
    # And no replica can post counts for another: the ledger files them under the poster,
    # which the coordinator takes from the credential (coordinator/detection.py).
    assert behind_across(0, counts(1, (30, 30), (1000, 999)), {0: counts(1, (0, 0), (0, 0))},
                         MEMBERS, [0]) is None


def test_a_liar_about_itself_condemns_only_itself():
    """Replica 2 posts that it is behind and stalled: it is named, as it asked; a waiting
    replica whose watchdog fired stays unblamed."""
    ledger = CollectiveLedger()
    hung_world(ledger)
    c = ledger.blame(1, 1, MEMBERS, now=10.0, stall_s=2.5)
    assert c is not None and c.replica == 2


def test_forgetting_a_replica_drops_its_counts():
    ledger = CollectiveLedger()
    hung_world(ledger)
    ledger.forget(2)
    assert ledger.view(2) == {} and ledger.blame(0, 1, MEMBERS, now=10.0, stall_s=2.5) is None


def test_the_counter_mirrors_into_its_file_and_reads_back_consistent(tmp_path):
    counter = collective_counts.CollectiveCounter()
    counter.group_entered()
    path = tmp_path / "collectives-r0-g0-a0-k0"
    counter.attach(path)
    counter.group_completed()
    counter.new_group(7)
    counter.ftar_entered()
    counter.ftar_entered()
    counter.ftar_completed()
    assert collective_counts.read(path) == collective_counts.Counts(7, 2, 1, 1, 1) == counter.counts()
    counter.detach()
    # A read between two slots' updates, or a file someone else wrote: completed <= entered.
    path.write_bytes(struct.pack("<5q", 3, 1, 5, -4, 2))
    assert collective_counts.read(path) == collective_counts.Counts(3, 1, 1, 0, 0)
    path.write_bytes(b"short")
    assert collective_counts.read(path) is None and collective_counts.read(tmp_path / "none") is None


def test_a_counter_detached_by_one_thread_never_fails_anothers_count(tmp_path):
    # Replicas as threads of one process share the counter: one replica's close used to
    # unmap the file between another's check and its store, and that store raised
    # "TypeError: argument must be read-write bytes-like object" inside its collective.
    counter = collective_counts.CollectiveCounter()
    errors: list[BaseException] = []
    stop = threading.Event()

    def count() -> None:
        try:
            while not stop.is_set():
                counter.ftar_entered()
                counter.ftar_completed()
        except BaseException as e:  # noqa: BLE001 - any failure is the finding
            errors.append(e)

    worker = threading.Thread(target=count)
    worker.start()
    try:
        for i in range(300):
            counter.attach(tmp_path / f"collectives-{i % 2}")
            counter.detach()
    finally:
        stop.set()
        worker.join(timeout=10)
    assert errors == [] and not worker.is_alive()
