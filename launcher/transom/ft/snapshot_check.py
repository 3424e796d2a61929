"""A joiner checks the snapshot it was sent against what the other replicas said of theirs.

A source replica fingerprints its parameters and optimizer state in the step it takes a
snapshot (ft/guard.py: the sum of their raw bits), and its launcher posts that row to the coordinator like any
other; the detectors keep, per (step, rank), the value a strict majority of two or more
replicas reported (detect/detectors.py, `GET /v1/fingerprints/{step}/{rank}`). Replicas are
bit-identical, so an honest snapshot of step N has exactly that fingerprint. Before a joiner
replays a single update on the shadow it built from a snapshot, it fingerprints the
shadow's parameters and optimizer state and asks:

- `agreed`: the snapshot is used only if the fingerprints are equal. A source that served
  zeros, or anything else than the state it and the others committed, is dropped
  (ft/sources.py) and the joiner fetches again from the others.
- `disputed` (replicas disagree without a strict majority): not used.
- `single` (one replica fingerprinted that step: a job of two replicas): used if it is what
  that replica said, since there is no other replica to compare with.
- nothing on record within `wait_s` (detection off, rows still on their way, the
  coordinator away): used unchecked; the log says so.

Nothing here decides anything for another replica: a joiner only refuses what it was sent.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from transom.coordinator.client import CoordinatorClient
from transom.detect.step_rows import MAX_FORWARD_INTERVAL_S
from transom.ft.guard import fingerprint, state_tensors

if TYPE_CHECKING:
    from transom.ft.catchup import Shadow
    from transom.ft.transfer import SnapshotManifest

log = logging.getLogger("transom.ft")
# Rows reach the coordinator within a launcher's post interval (at most 30 s) and are judged
# once every replica's are in: the record of a step is there within two intervals.
WAIT_S = 2 * MAX_FORWARD_INTERVAL_S + 5.0
POLL_S = 0.1  # the record comes as soon as the rows of recovery steps do (launch/signal_forwarder.py)


class SnapshotCheck:
    """`Joiner.verify` for one rank: True if the shadow built from `manifest` may be used."""

    def __init__(self, client: CoordinatorClient, rank: int, enabled: bool = True, wait_s: float = WAIT_S):
        self.client, self.rank, self.enabled, self.wait_s = client, rank, enabled, wait_s

    def __call__(self, manifest: SnapshotManifest, shadow: Shadow) -> bool:
        if not self.enabled:
            return True  # detection off: no replica fingerprints anything
        mine = int(fingerprint(state_tensors(shadow.model_params, shadow.optimizer)).item())
        deadline = time.monotonic() + self.wait_s
        while True:
            try:
                record = self.client.fingerprint(manifest.step, self.rank, timeout_s=5.0)
            except Exception as e:  # the coordinator away: as if nothing were on record
                log.debug("snapshot check of step %d: %s", manifest.step, e)
                record = None
            if record is not None and record.state != "unknown":
                break
            if time.monotonic() + POLL_S > deadline:
                log.warning("rank %d: no fingerprint of step %d on record within %.0fs; using the snapshot unchecked",
                            self.rank, manifest.step, self.wait_s)
                return True
            time.sleep(POLL_S)
        if record.state == "disputed":
            log.warning("rank %d: the replicas disagree about step %d; its snapshot is refused",
                        self.rank, manifest.step)
            return False
        if record.value != mine:
            log.warning("rank %d: the snapshot of step %d is not the state the replicas committed (fingerprint %d, "
                        "theirs %d, %s): refused", self.rank, manifest.step, mine, record.value, record.state)
        return record.value == mine
