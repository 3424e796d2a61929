"""Which snapshot a joiner takes, and from which sources: no source is believed on its word alone.

The coordinator names the sources, but what one serves is only that replica's claim (a bug,
a bad host, a script that lies). A joiner takes a snapshot on three conditions, checked
for each source before anything of the snapshot's size is allocated:

1. **It could be this replica's state** (ft/expected.py): the manifest is no longer than
   the joiner's own state implies, and names exactly the tensors of the joiner's own model
   and optimizer, with their dtypes and shapes.
2. **Its step is possible**: at most the newest step the joiner has seen committed. The
   joiner trains in step with the others and records every commit; a source snapshots
   after a commit and publishes after the next exchange, which the joiner takes part in,
   so no honest source serves a step the joiner has not seen. (A step below `need_from`
   is an honest older snapshot: not the one wanted yet, and not held against the source.)

   A source that fails 1 or 2, or serves a manifest that does not parse, is dropped for
   the rest of the catch-up, logged once with the first thing wrong.
3. **A strict majority of the sources asked serves exactly it**: the same manifest, byte
   for byte (replicas are bit-identical, so the honest sources of one step serve the same
   bytes). Sources that have nothing yet, or an older step, count among those asked: a
   source that answers first is not a majority of three. Without a majority (two sources
   that disagree, one that answered while another still hashes), the joiner asks again
   every 50 ms. Once that has lasted `UNDECIDED_WAIT_S`, a joiner that verifies what it
   builds (`Joiner.verify`) tries the snapshot served by the most sources, ties to the
   *lowest* step, and one that fails the verification drops its sources (`refuse`). One
   that does not verify asks its sources for a snapshot newer than any of these
   (`ask_newer`, once per search: the honest ones take it at the same commit and then
   agree) and goes on waiting, up to its timeout.

So one lying source wins nothing by its claim: not by a higher step, a larger size or by
answering first. Against two honest sources it is a minority; against one, a tie that
is decided only by a verification, or not at all (the joiner times out and its replica
restarts, rather than training on a state only the liar vouches for). A job with a single
source has nothing to compare it with: there the verification is the only check. This
decides which manifest is believed; each chunk is then checked against its CRC32C, which
catches a corrupted chunk but not a forged one (ft/transfer.py).
"""

from __future__ import annotations

import http.client
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from transom.errors import WireError
from transom.ft import transfer
from transom.ft.expected import ExpectedState
from transom.ft.transfer import SnapshotManifest

log = logging.getLogger("transom.ft")
# Without a majority for this long, ask for a newer snapshot (or try one, verified). Sources
# of one step publish within moments of each other; a larger model's slower hashing costs
# at most one snapshot more.
UNDECIDED_WAIT_S = 2.0
POLL_S = 0.05
ASK_TIMEOUT_S = 10.0  # one source's answer to GET /snapshot


class SnapshotUse(StrEnum):
    """What a joiner's verification of a snapshot it built says (`Joiner.verify`)."""

    USE = "use"
    REFUSE = "refuse"  # not the state the replicas committed: never taken again, its sources dropped
    ELSEWHERE = "elsewhere"  # unconfirmed while another source is left: its sources dropped, it not condemned


@dataclass
class Choice:
    """A snapshot to fetch: its manifest, the sources that serve it, and the others asked
    (`late`: they may serve it once they have hashed theirs, ft/transfer.fetch)."""

    manifest: SnapshotManifest
    serving: list[str]
    late: list[str] = field(default_factory=list)


def _identity(m: SnapshotManifest) -> tuple[int, tuple[int, ...]]:
    """What a chunk is checked against: a refused snapshot is this, whatever else its manifest says."""
    return m.step, tuple(m.digests)


class Sources:
    """A joiner's sources across its searches: which are dropped and why, which snapshots were
    refused. `endpoints()` is asked again at each poll: sources come and go with the rounds."""

    def __init__(self, endpoints: Callable[[], Sequence[str]], token: str, timeout_s: float, expected: ExpectedState):
        self.endpoints, self.token, self.timeout_s, self.expected = endpoints, token, timeout_s, expected
        self.dropped: dict[str, str] = {}  # endpoint -> why, for the rest of the catch-up
        self._refused: set[tuple[int, tuple[int, ...]]] = set()
        self._last = "no source known"

    def drop(self, endpoints: Sequence[str], why: str) -> None:
        for ep in endpoints:
            if ep not in self.dropped:
                self.dropped[ep] = why
                log.warning("catch-up: dropping source %s: %s", ep, why)

    def refuse(self, manifest: SnapshotManifest, endpoints: Sequence[str], why: str) -> None:
        """The snapshot `manifest` describes is not to be used: its sources are dropped, and so
        is any other that serves it later."""
        self._refused.add(_identity(manifest))
        self.drop(endpoints, why)

    def offer(self, ep: str, bounds: Callable[[], tuple[int, int]]) -> tuple[SnapshotManifest, bytes] | None:
        """`ep`'s snapshot and its manifest's bytes, if it is one the joiner could take now
        (`bounds()`: the oldest step wanted, the newest committed); None if it has none yet
        (or an older one), cannot be reached, or was dropped now."""
        try:
            status, body = transfer.http_get(ep, "/snapshot", self.token, min(ASK_TIMEOUT_S, self.timeout_s),
                                             self.expected.max_manifest_bytes)
            manifest = transfer.parse_manifest(body) if status == 200 else None
        except WireError as e:
            self.drop([ep], str(e))
            return None
        except (OSError, http.client.HTTPException) as e:  # it may be restarting: the rounds will say
            self._last = f"{ep}: {e}"
            return None
        if manifest is None:
            self._last = f"{ep}: no snapshot yet ({status})"
            return None
        # Read after the answer came: the joiner may have seen a commit meanwhile, and the
        # source may have published that step's snapshot before it answered.
        need_from, newest = bounds()
        why = self.expected.mismatch(manifest)
        if why is None and manifest.step > newest:
            why = f"a snapshot of step {manifest.step}, newer than the newest committed step ({newest})"
        if why is None and _identity(manifest) in self._refused:
            why = f"it serves the snapshot of step {manifest.step} that was refused"
        if why is not None:
            self.drop([ep], why)
            return None
        if manifest.step < need_from:
            self._last = f"{ep}: a snapshot of step {manifest.step}, older than step {need_from}"
            return None
        return manifest, body

    def find(self, bounds: Callable[[], tuple[int, int]], stopped: Callable[[], bool] = lambda: False,
             ask_newer: Callable[[], None] | None = None, verified: bool = False) -> Choice:
        """Poll the sources until a strict majority of them serves one snapshot the joiner
        could take (`bounds()`: the oldest step wanted and the newest committed, asked again
        at each poll); with `verified` (the caller verifies what it builds), the most served
        one once none has had a majority for UNDECIDED_WAIT_S. TimeoutError after the
        joiner's timeout, InterruptedError once `stopped()`."""
        deadline = time.monotonic() + self.timeout_s
        undecided_since: float | None = None
        asked_newer = False
        while not stopped():
            offers: dict[bytes, Choice] = {}
            asked = [ep for ep in self.endpoints() if ep not in self.dropped]
            for ep in asked:
                got = self.offer(ep, bounds)
                if got is not None:
                    offers.setdefault(got[1], Choice(got[0], [])).serving.append(ep)
            # Those dropped just now showed they are not honest sources: they do not count.
            asked = [ep for ep in asked if ep not in self.dropped]
            best = min(offers.values(), key=lambda c: (-len(c.serving), c.manifest.step), default=None)
            if best is not None and 2 * len(best.serving) > len(asked):
                return Choice(best.manifest, best.serving, [ep for ep in asked if ep not in best.serving])
            now = time.monotonic()
            if best is not None:
                undecided_since = now if undecided_since is None else undecided_since
                self._last = (f"{len(best.serving)} of {len(asked)} sources serve the snapshot of step "
                              f"{best.manifest.step}, {len(offers)} different ones are served")
                if now - undecided_since >= UNDECIDED_WAIT_S:
                    if verified:
                        log.info("catch-up: no majority of the sources serves one snapshot (%s); trying the "
                                 "one of step %d and verifying it", self._last, best.manifest.step)
                        return Choice(best.manifest, best.serving, [ep for ep in asked if ep not in best.serving])
                    if ask_newer is not None and not asked_newer:
                        log.info("catch-up: %s; asking for a newer snapshot", self._last)
                        ask_newer()
                        asked_newer = True
            if now >= deadline:
                dropped = "; ".join(f"{ep} dropped: {why}" for ep, why in list(self.dropped.items())[-3:])
                raise TimeoutError(f"no snapshot of step >= {bounds()[0]} that a majority of the sources serve "
                                   f"within {self.timeout_s:g}s: {self._last}" + (f"; {dropped}" if dropped else ""))
            time.sleep(POLL_S)
        raise InterruptedError("stopped")
