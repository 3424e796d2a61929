"""The coordinator's Prometheus metrics, read from the live membership and detection at
scrape time (`GET /metrics` of server.py). Labels are bounded: reason and verdict kinds, the
endpoints that refuse a stale incarnation (fencing.py), and replica ids of the share vector
(at most the job's replicas)."""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from transom.coordinator.membership import Membership
from transom.coordinator.reports import in_checkpoint_trouble
from transom.coordinator.shared import Shared
from transom.detect.detectors import KINDS
from transom.words import FailureKind


class MembershipCollector:
    """Reads the live membership at scrape time; labels are bounded (reason kinds only)."""

    def __init__(self, shared: Shared):
        self.shared = shared

    def collect(self):
        m = self.shared.membership
        g = GaugeMetricFamily("transom_coordinator_healthy_replicas", "Replicas currently healthy")
        g.add_metric([], m.replicas.healthy_count())
        yield g
        g = GaugeMetricFamily("transom_coordinator_step", "Highest committed step reported by any replica")
        g.add_metric([], m.replicas.max_step())
        yield g
        g = GaugeMetricFamily("transom_coordinator_quorum_id", "Current quorum id")
        g.add_metric([], m.current.quorum_id if m.current else -1)
        yield g
        # Who trains now: members of the current round, and of them those that contribute
        # gradients (not catching up). A replica is back once it is a contributor again.
        current = m.current
        g = GaugeMetricFamily("transom_coordinator_quorum_members", "Replicas in the current round")
        g.add_metric([], len(current.members) if current else 0)
        yield g
        g = GaugeMetricFamily("transom_coordinator_contributing_replicas",
                              "Replicas of the current round that contribute gradients (not catching up)")
        g.add_metric([], len(current.members) - len(current.recovering) if current else 0)
        yield g
        g = GaugeMetricFamily("transom_coordinator_paused", "1 while fewer than minReplicas are ready")
        g.add_metric([], 1 if m.paused else 0)
        yield g
        # Alerts on a job that does not progress leave a finished one alone (its coordinator
        # stays for inspection, its step still).
        g = GaugeMetricFamily("transom_coordinator_completed", "1 once the job has trained to its last step")
        g.add_metric([], 1 if m.completed_step is not None else 0)
        yield g
        c = CounterMetricFamily("transom_coordinator_quorum_changes", "Quorums formed with new membership")
        c.add_metric([], m.quorum_changes_total)
        yield c
        c = CounterMetricFamily(
            "transom_coordinator_replica_failures", "Replica incarnations declared failed", labels=["reason"]
        )
        for reason in FailureKind:
            c.add_metric([reason], m.failures_total.get(reason, 0))
        yield c
        yield from self._refused()
        yield from self._detection()
        g = GaugeMetricFamily("transom_coordinator_batch_share",
                              "A replica's share of the global batch (1 nominal), while Rebalance is in force",
                              labels=["replica"])
        for replica, share in enumerate(m.shares.published or []):
            if m.shares.members is None or replica in m.shares.members:  # one outside takes no samples
                g.add_metric([str(replica)], share)
        yield g
        yield from self._progress(m)

    def _refused(self):
        """Calls refused at the door: stale incarnations (409) and unknown credentials (401)."""
        c = CounterMetricFamily("transom_coordinator_fenced_requests",
                                "Calls refused (409) because the calling incarnation was superseded, declared failed "
                                "or left: what a zombie tried", labels=["endpoint"])
        for endpoint in self.shared.refusals.endpoints():
            c.add_metric([endpoint], self.shared.refusals.counts.get(endpoint, 0))
        yield c
        c = CounterMetricFamily("transom_coordinator_unauthenticated_requests",
                                "Calls refused (401) for a missing or unknown credential, "
                                "such as a deleted pod's token",
                                labels=["endpoint"])
        for endpoint in self.shared.refusals.endpoints():
            c.add_metric([endpoint], self.shared.refusals.unauthenticated.get(endpoint, 0))
        yield c

    def _detection(self):
        """What the detectors found and what they turned away."""
        c = CounterMetricFamily("transom_coordinator_verdicts", "Anomalies found by the detectors", labels=["kind"])
        for kind in KINDS:
            c.add_metric([kind], self.shared.detection.verdicts_total.get(kind, 0))
        yield c
        c = CounterMetricFamily("transom_coordinator_signal_rows_refused",
                                "Signal rows refused: a step or rank its replica cannot have")
        c.add_metric([], self.shared.detection.rows_refused)
        yield c
        c = CounterMetricFamily("transom_coordinator_signal_posts_deferred",
                                "Signal posts answered 429 (too soon, or the detectors' time budget spent)")
        c.add_metric([], self.shared.signal_gate.deferred)
        yield c

    def _progress(self, m: Membership):
        """Goodput and the newest checkpoint: families without a sample until they are known,
        so a dashboard shows "no data" rather than a made-up 0 (an age since 1970)."""
        g = GaugeMetricFamily("transom_coordinator_goodput", "Fraction of time spent on steps that were kept")
        goodput = m.goodput.value(self.shared.clock())
        if goodput is not None:
            g.add_metric([], goodput)
        yield g
        step = GaugeMetricFamily("transom_coordinator_last_checkpoint_step", "Step of the newest committed checkpoint")
        wall = GaugeMetricFamily("transom_coordinator_last_checkpoint_timestamp_seconds",
                                 "Unix time the newest committed checkpoint was reported")
        if m.last_checkpoint is not None:
            step.add_metric([], m.last_checkpoint[0])
            wall.add_metric([], m.last_checkpoint[1])
        yield step
        yield wall
        stall = GaugeMetricFamily("transom_coordinator_checkpoint_stall_seconds",
                                  "How long the training loop waited for the newest checkpoint's memory snapshot")
        if m.last_checkpoint_stall_s is not None:
            stall.add_metric([], m.last_checkpoint_stall_s)
        yield stall
        trouble = GaugeMetricFamily("transom_coordinator_checkpoint_trouble_replicas",
                                    "Healthy replicas whose checkpoint writer says it is failing and retrying")
        trouble.add_metric([], len(in_checkpoint_trouble(m)))
        yield trouble
