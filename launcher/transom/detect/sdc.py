"""Silent data corruption: replicas that should hold the same parameters, and do not.

Every `fingerprint_interval` steps each rank reduces its parameters after the optimizer step
to one 64-bit number on its device (ft/guard.py: the sum of the raw bits as integers, which
any flipped bit changes and which no order of summation changes). Replicas hold identical
state, so rank k of every replica must report the same number for the same step. A replica
whose number differs from a strict majority's is corrupt; with no strict majority (two
replicas that disagree) nobody can be blamed, and that is reported as such.
"""

from __future__ import annotations

import collections
from collections.abc import Mapping


def minority(fingerprints: Mapping[int, int]) -> tuple[list[int], bool]:
    """(replicas that disagree with a strict majority, whether the replicas disagree at all)."""
    counts = collections.Counter(fingerprints.values())
    if len(counts) <= 1:
        return [], False
    value, n = counts.most_common(1)[0]
    if 2 * n <= len(fingerprints):
        return [], True  # no strict majority: a disagreement without a culprit
    return sorted(r for r, v in fingerprints.items() if v != value), True
