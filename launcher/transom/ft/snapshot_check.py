"""A joiner checks the snapshot it was sent against what the other replicas said of theirs.

A source replica fingerprints its parameters and optimizer state in the step it takes a
snapshot (ft/guard.py: the sum of their raw bits; summed beside the next step,
ft/state_print.py), and its launcher posts that row to the coordinator like any other; the
detectors keep, per (step, rank), the value a strict majority of two or more replicas
reported (detect/detectors.py, `GET /v1/fingerprints/{step}/{rank}`). Replicas are
bit-identical, so an honest snapshot of step N has exactly that fingerprint. Before a joiner
replays a single update on the shadow it built from a snapshot, it fingerprints the
shadow's parameters and optimizer state, asks, and decides (`decide`, pure):

- `agreed`: used only if the fingerprints are equal. A source that served zeros, or
  anything else than the state it and the others committed, is refused (`REFUSE`: dropped,
  ft/sources.py) and the joiner fetches again from the others.
- `disputed` (replicas disagree without a strict majority), or a `single` value that is not
  the shadow's: refused.
- unconfirmed: a `single` record that matches (one replica fingerprinted that step, maybe
  the source itself), nothing on record within `wait_s` (rows late, the coordinator away),
  or anomaly detection off (no replica fingerprints anything). Nobody but the snapshot's
  own source then vouches for it, unless two or more sources serve it byte for byte:
  - two or more serve it: used, with a warning that its fingerprint was not confirmed;
  - one serves it and another source is left: set aside (`ELSEWHERE`: its source is
    dropped for this catch-up, the snapshot itself is not condemned) and another source
    tried, which the record may confirm or whose snapshot a majority serves;
  - one serves it and no other source is left: used, with a warning saying so.

The trade-off: a job of two replicas has one source; refusing what nobody else can confirm
would make every catch-up there fail, so there the one source's word is taken and the log
says so. Where another source exists, one lying source costs at most a retry, never the
joiner's state. With detection off the coordinator has no fingerprints to keep: the
trainers take none (ft/guard.py runs only with detection on), so keeping records without
the detectors would close nothing until the sources fingerprint their snapshots anyway;
until then such a joiner relies on the sources' majority (ft/sources.py) alone, and says so.
A retry elsewhere costs another `wait_s` when that source's record does not come either.

Nothing here decides anything for another replica: a joiner only refuses what it was sent.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from transom.coordinator.client import CoordinatorClient
from transom.coordinator.models import FingerprintRecord
from transom.detect.step_rows import MAX_FORWARD_INTERVAL_S
from transom.ft.guard import fingerprint, state_tensors
from transom.ft.sources import SnapshotUse

if TYPE_CHECKING:
    from transom.ft.catchup import Shadow
    from transom.ft.transfer import SnapshotManifest

log = logging.getLogger("transom.ft")
# Rows reach the coordinator within a launcher's post interval (at most 30 s) and are judged
# once every replica's are in: the record of a step is there within two intervals.
WAIT_S = 2 * MAX_FORWARD_INTERVAL_S + 5.0
POLL_S = 0.1  # the record comes as soon as the rows of recovery steps do (launch/signal_forwarder.py)
DETECTION_OFF = "anomaly detection is off: no replica fingerprints its state"


def decide(record: FingerprintRecord | None, mine: int, serving: int, others: int,
           unrecorded: str = "no fingerprint on record") -> tuple[SnapshotUse, str]:
    """What a joiner does with a snapshot whose shadow fingerprints to `mine`, and why.

    `record`: the replicas' record of its step (None: none came, `unrecorded` says why);
    `serving`: the sources that serve this very snapshot; `others`: the sources not serving
    it and not dropped, which the joiner could still ask."""
    if record is not None and record.state == "disputed":
        return SnapshotUse.REFUSE, "the replicas disagree about this step"
    if record is not None and record.value != mine:
        return SnapshotUse.REFUSE, (f"not the state the replicas committed (fingerprint {mine}, theirs "
                                    f"{record.value}, {record.state})")
    if record is not None and record.state == "agreed":
        return SnapshotUse.USE, "its fingerprint is the one the replicas agree on"
    why = "only one replica fingerprinted this step" if record is not None else unrecorded
    if serving >= 2:
        return SnapshotUse.USE, f"{why}; used unconfirmed, as the {serving} sources that serve it agree"
    if others > 0:
        return SnapshotUse.ELSEWHERE, f"{why}, and only its source vouches for it; trying another source"
    return SnapshotUse.USE, f"{why}, and no other source is left; used on its one source's word"


class SnapshotCheck:
    """`Joiner.verify` for one rank: whether the shadow built from `manifest` may be used."""

    def __init__(self, client: CoordinatorClient, rank: int, enabled: bool = True, wait_s: float = WAIT_S):
        self.client, self.rank, self.enabled, self.wait_s = client, rank, enabled, wait_s

    def __call__(self, manifest: SnapshotManifest, shadow: Shadow, serving: int = 1, others: int = 0) -> SnapshotUse:
        mine = int(fingerprint(state_tensors(shadow.model_params, shadow.optimizer)).item())
        record = self._record(manifest.step) if self.enabled else None
        unrecorded = DETECTION_OFF if not self.enabled else f"no fingerprint on record within {self.wait_s:.0f}s"
        use, why = decide(record, mine, serving, others, unrecorded)
        if use is SnapshotUse.USE and (record is None or record.state != "agreed"):
            log.warning("rank %d: the snapshot of step %d: %s", self.rank, manifest.step, why)
        elif use is not SnapshotUse.USE:
            log.warning("rank %d: the snapshot of step %d is %s: %s", self.rank, manifest.step,
                        "refused" if use is SnapshotUse.REFUSE else "set aside", why)
        return use

    def _record(self, step: int) -> FingerprintRecord | None:
        """The replicas' record of `step`, asked until one is there or `wait_s` has passed."""
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                record = self.client.fingerprint(step, self.rank, timeout_s=5.0)
            except Exception as e:  # the coordinator away: as if nothing were on record
                log.debug("snapshot check of step %d: %s", step, e)
                record = None
            if record is not None and record.state != "unknown":
                return record
            if time.monotonic() + POLL_S > deadline:
                return None
            time.sleep(POLL_S)
