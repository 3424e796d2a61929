"""The duplicate-data detector (detect/duplicates.py) under digest floods: one replica posts
arbitrary (step, rank, digest) rows, as many as it likes, interleaved with honest replicas'.

Honest replicas 0..3 train on distinct inputs except replicas 0 and 1, which share theirs
(the bug the detector exists for), and each of their ranks 0 and 1 share an input with each
other (tensor-parallel peers). Replica 4 is the flooder: its steps are any due or undue step
up to 2^62, its ranks any of 64, its digests arbitrary or copies of the honest ones. Whatever
it posts: memory stays bounded (each replica's digests, the pairs kept), the pair of replicas
0 and 1 is found and shown with every step it showed, and no pair is made between honest
replicas that trained on distinct inputs.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from transom.detect.duplicates import MAX_PARTNERS, MAX_STEPS, DuplicateInputs
from transom.detect.step_rows import INPUT_DIGEST_INTERVAL

FLOODER, RANKS, FLOOD_RANKS = 4, 2, 64
HONEST_STEPS = [0, 1, 2, 50, 100, 150]
DUE_HUGE = (2**62 // INPUT_DIGEST_INTERVAL) * INPUT_DIGEST_INTERVAL


def honest_digest(step: int, replica: int) -> int:
    return step * 100 + (0 if replica == 1 else replica)  # replica 1 trains on replica 0's inputs


STEPS = st.one_of(st.sampled_from(HONEST_STEPS), st.integers(0, 2**62),
                  st.integers(0, 2**62 // INPUT_DIGEST_INTERVAL).map(lambda k: k * INPUT_DIGEST_INTERVAL),
                  st.integers(0, 40).map(lambda k: DUE_HUGE - k * INPUT_DIGEST_INTERVAL))
DIGESTS = st.one_of(st.integers(-(2**63), 2**63 - 1),
                    st.tuples(st.sampled_from(HONEST_STEPS), st.integers(0, 3)).map(lambda t: honest_digest(*t)))
FLOOD = st.lists(st.tuples(STEPS, st.integers(0, FLOOD_RANKS - 1), DIGESTS), max_size=300)


@given(flood=FLOOD, when=st.integers(0, len(HONEST_STEPS)))
def test_a_digest_flood_stays_bounded_and_hides_no_pair(flood, when):
    d = DuplicateInputs()

    def honest(steps: list[int]) -> None:
        for step in steps:
            for replica in range(4):
                for rank in range(RANKS):
                    d.observe(step, replica, rank, honest_digest(step, replica))

    honest(HONEST_STEPS[:when])  # the flood comes at any point of the honest replicas' steps
    for step, rank, digest in flood:
        d.observe(step, FLOODER, rank, digest)
    honest(HONEST_STEPS[when:])

    assert d.kept(FLOODER) <= MAX_STEPS * FLOOD_RANKS
    assert all(d.kept(r) <= MAX_STEPS * RANKS for r in range(4))
    assert len(d.pairs()) <= 5 * MAX_PARTNERS
    pairs = d.pairs()
    # The honest pair, with the steps that showed it (those honest steps each replica still kept).
    assert pairs[(0, 1)] == (HONEST_STEPS[0], HONEST_STEPS[-1])
    assert not any(a < b < FLOODER and (a, b) != (0, 1) for a, b in pairs)  # a liar names only its own pairs
    found = d.finding
    assert found is not None and found.across and {0, 1} <= set(found.replicas)
    assert len(found.message) <= 1024
